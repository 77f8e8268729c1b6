#!/usr/bin/env bash
# Helpers shared by the launch scripts (sourced, not run).

# die MESSAGE: print "<script>: MESSAGE" to stderr and exit 2.
die() {
    echo "$(basename "$0"): $*" >&2
    exit 2
}

# is_uint VALUE: true when VALUE is a non-negative integer.
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

# require_int NAME VALUE MIN [MAX]: die unless VALUE is an integer in [MIN, MAX].
require_int() {
    local name=$1 value=$2 min=$3 max=${4:-}
    if ! is_uint "$value" || (( value < min )) || { [[ -n "$max" ]] && (( value > max )); }; then
        die "$name must be an integer in [$min, ${max:-inf}], got '$value'"
    fi
}

# gpus_per_node: GPUS_PER_NODE, else the number of GPUs nvidia-smi lists; validated.
gpus_per_node() {
    local n
    if [[ -n "${GPUS_PER_NODE:-}" ]]; then
        n=$GPUS_PER_NODE
    elif command -v nvidia-smi >/dev/null 2>&1; then
        n=$(nvidia-smi -L | grep -c '^GPU ' || true)
    else
        die "GPUS_PER_NODE is not set and nvidia-smi is not available to count GPUs"
    fi
    require_int GPUS_PER_NODE "$n" 1
    echo "$n"
}

# split_train_args ARGS...: sets RUN_DIR_ARGS (the --run-dir option, if given) and
# OVERRIDE_ARGS (everything else) so that wrappers can put their own overrides before the
# user's (the last value of a key wins).
# shellcheck disable=SC2034  # both arrays are read by the scripts that source this file
split_train_args() {
    RUN_DIR_ARGS=()
    OVERRIDE_ARGS=()
    while (( $# )); do
        case "$1" in
            --run-dir)
                (( $# >= 2 )) || die "--run-dir needs a directory"
                RUN_DIR_ARGS=(--run-dir "$2")
                shift 2
                ;;
            --run-dir=*)
                RUN_DIR_ARGS=(--run-dir "${1#--run-dir=}")
                shift
                ;;
            *=*)
                OVERRIDE_ARGS+=("$1")
                shift
                ;;
            *)
                die "expected --run-dir DIR or section.key=value, got '$1'"
                ;;
        esac
    done
}

# json_list ITEMS...: a JSON list of strings (a YAML flow sequence the config overrides accept).
json_list() {
    local out="" item
    for item in "$@"; do
        out+="${out:+,}\"${item}\""
    done
    echo "[${out}]"
}

# Highest port an SGLang 0.5.12 server accepts: it sets its gRPC port to port + 10000 and
# refuses one above 65535 (sglang/srt/server_args.py, _handle_deprecated_args).
# shellcheck disable=SC2034  # read by the scripts that source this file
MAX_SERVER_PORT=55535

# rollout_dtype: ROLLOUT_DTYPE (default bfloat16), validated.
rollout_dtype() {
    local d=${ROLLOUT_DTYPE:-bfloat16}
    case "$d" in
        bfloat16|float16|float32) echo "$d" ;;
        *) die "ROLLOUT_DTYPE must be bfloat16, float16 or float32, got '$d'" ;;
    esac
}

# bind_address VALUE: the address servers bind to. "internal" is the address this node's
# hostname resolves to (the one other nodes of the cluster use); anything else is taken as is.
bind_address() {
    local value=$1 addr
    if [[ "$value" != internal ]]; then
        [[ -n "$value" && "$value" != *[[:space:]]* ]] || die "ROLLOUT_HOST: bad address '$value'"
        echo "$value"
        return
    fi
    addr=$(getent hosts "$(hostname)" 2>/dev/null | awk 'NR == 1 {print $1}')
    if [[ -z "$addr" || "$addr" == 127.* || "$addr" == ::1 ]]; then
        addr=$(hostname -I 2>/dev/null | awk '{print $1}')
    fi
    [[ -n "$addr" ]] || die "ROLLOUT_HOST=internal: cannot find this node's address; set ROLLOUT_HOST to it"
    echo "$addr"
}

# gpu_memory: GPU_MEMORY, else the smallest memory.total nvidia-smi lists (as "<MiB>MiB"), else
# nothing (no GPU known: the plan then checks the layout, not the memory).
gpu_memory() {
    local mib
    if [[ -n "${GPU_MEMORY:-}" ]]; then
        echo "$GPU_MEMORY"
    elif command -v nvidia-smi >/dev/null 2>&1; then
        mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null \
              | sort -n | head -n 1 | tr -d ' ')
        is_uint "$mib" || die "nvidia-smi did not report the GPUs' memory; set GPU_MEMORY (e.g. 80GiB)"
        echo "${mib}MiB"
    fi
}

# run_plan CONFIG NNODES GPUS_PER_NODE: `megatron-gspo plan --brief` on CONFIG with the
# overrides in OVERRIDE_ARGS (split_train_args) on NNODES x GPUS_PER_NODE GPUs; sets plan_lines
# (its output lines: rollout, learner, verdict; or its one-line error) and plan_rc (0 fits,
# 1 does not fit or would be refused, 2 a config error).
# shellcheck disable=SC2034  # plan_lines and plan_rc are read by the scripts that source this
run_plan() {
    local config=$1 nodes=$2 gpus=$3 mem out
    mem=$(gpu_memory)
    local args=(plan "$config" --brief --nodes "$nodes" --gpus-per-node "$gpus"
                --gpu-memory "${mem:-unknown}")
    if [[ -n "${MODEL_CONFIG:-}" ]]; then
        args+=(--model-config "$MODEL_CONFIG")
    fi
    plan_rc=0
    out=$("${MEGATRON_GSPO:-megatron-gspo}" "${args[@]}" "${OVERRIDE_ARGS[@]}" 2>&1) || plan_rc=$?
    mapfile -t plan_lines <<< "$out"
    if (( plan_rc > 1 )) && (( ${#plan_lines[@]} )); then  # a config error: its last line
        plan_lines=("plan: ${plan_lines[-1]}")
    fi
}

# plan_refusal: the line of plan_lines that says why the plan refused.
plan_refusal() {
    local line
    for line in "${plan_lines[@]}"; do
        [[ "$line" == plan:* ]] && { echo "$line"; return; }
    done
    echo "plan: ${plan_lines[-1]:-megatron-gspo plan failed}"
}

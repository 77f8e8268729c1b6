#!/usr/bin/env bash
# Disaggregated rollouts: SGLang servers run on their own GPUs (usually their own nodes); the
# learner attaches to them over HTTP and, after each update, broadcasts the new weights to them
# over an NCCL group (learner rank 0 + every server GPU).
#
# Usage:
#   disaggregated.sh [--dry-run] rollout MODEL_DIR     start this node's SGLang servers, wait
#   disaggregated.sh [--dry-run] [--skip-plan] learner CONFIG.yaml [--run-dir DIR] [key=value ...]
#                                                       the learner (torchrun.sh: the memory plan
#                                                       of this exact command runs first)
#
# rollout role, environment:
#   GPUS_PER_NODE         GPUs on this node used for serving        (default: nvidia-smi count)
#   ROLLOUT_TP            tensor-parallel size of each server       (default 1)
#   ROLLOUT_BASE_PORT     port of the first server; server i uses base + i   (default 30000;
#                         the last port must be at most 55535: SGLang adds 10000 for its gRPC
#                         port and refuses anything above 65535)
#   ROLLOUT_MEM_FRACTION  SGLang --mem-fraction-static              (default 0.85)
#   ROLLOUT_DTYPE         SGLang --dtype: the dtype the learner exports its weights in, i.e.
#                         its model.dtype (default bfloat16, model.dtype's default; SGLang's
#                         own "auto" would serve a float32 checkpoint in float16)
#   ROLLOUT_HOST          address the servers bind to (default 127.0.0.1: this node only).
#                         "internal": the address this node's hostname resolves to (the
#                         cluster-internal one, which learners on other nodes reach); or any
#                         literal address. 0.0.0.0 exposes the servers on every interface.
#   SGLANG_API_KEY        when set, every server requires it (SGLang --api-key: every endpoint
#                         but /health* and /metrics* wants "Authorization: Bearer <key>")
#   LOG_DIR               server logs go to LOG_DIR/sglang_<host>_<i>.log (default: stdout)
#   SGLANG_EXTRA_ARGS     extra arguments for every server (word-split)
#   SGLANG_SERVER_MODULE  Python module run with SGLang's flags (default sglang.launch_server)
# learner role: the config's settings stand, except the placement this role is: it adds
# rollout.engine=sglang, rollout.colocate=false, rollout.server_urls and
# rollout.weight_sync=distributed. Environment: torchrun.sh's (NNODES counts learner nodes only,
# GPU_MEMORY, MODEL_CONFIG, SKIP_PLAN) plus
#   ROLLOUT_URLS          comma-separated server URLs, e.g. http://node2:30000,http://node2:30001
#   ROLLOUT_DTYPE         when set, also the learner's model.dtype (before the user's overrides)
#   SGLANG_API_KEY        when set, the learner sends it (rollout.api_key_env=SGLANG_API_KEY: the
#                         config names the variable, the key itself stays in the environment)
# The servers accept pickled weight payloads (/update_weights_from_tensor) and join NCCL groups
# on request (/init_weights_update_group): whoever reaches their port controls them. Bind them
# to an address only the cluster reaches and set SGLANG_API_KEY (docs/multinode.md, "Security").
set -euo pipefail
here=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=docker/launch/common.sh
source "$here/common.sh"

dry_run=0
while (( $# )); do
    case "$1" in
        --dry-run) dry_run=1; shift ;;
        --skip-plan) export SKIP_PLAN=1; shift ;;
        *) break ;;
    esac
done
usage="usage: disaggregated.sh [--dry-run] [--skip-plan] rollout MODEL_DIR | learner CONFIG.yaml [args ...]"
(( $# >= 2 )) || die "$usage"
role=$1
shift

run_learner() {
    local config=$1
    shift
    split_train_args "$@"
    [[ -n "${ROLLOUT_URLS:-}" ]] || die "ROLLOUT_URLS (comma-separated SGLang server URLs) is required"
    local urls=() url
    IFS=',' read -r -a urls <<< "$ROLLOUT_URLS"
    for url in "${urls[@]}"; do
        [[ "$url" =~ ^https?://[^/:]+:[0-9]+/?$ ]] || die "ROLLOUT_URLS: bad server URL '$url'"
    done
    local dry=() extra=()
    (( dry_run )) && dry=(--dry-run)
    if [[ -n "${ROLLOUT_DTYPE:-}" ]]; then
        extra+=("model.dtype=$(rollout_dtype)")
    fi
    if [[ -n "${SGLANG_API_KEY:-}" ]]; then
        extra+=(rollout.api_key_env=SGLANG_API_KEY)
    fi
    exec "$here/torchrun.sh" "${dry[@]}" "$config" "${RUN_DIR_ARGS[@]}" \
        rollout.engine=sglang \
        rollout.colocate=false \
        "rollout.server_urls=$(json_list "${urls[@]}")" \
        rollout.weight_sync=distributed \
        "${extra[@]}" \
        "${OVERRIDE_ARGS[@]}"
}

run_rollout() {
    local model=$1
    (( $# == 1 )) || die "rollout role takes exactly one argument, MODEL_DIR"
    local gpus tp base mem host dtype
    gpus=$(gpus_per_node)
    tp=${ROLLOUT_TP:-1}
    require_int ROLLOUT_TP "$tp" 1 "$gpus"
    (( gpus % tp == 0 )) || die "ROLLOUT_TP=$tp must divide GPUS_PER_NODE=$gpus"
    base=${ROLLOUT_BASE_PORT:-30000}
    # Server i listens on base + i; SGLang refuses a port above MAX_SERVER_PORT.
    require_int ROLLOUT_BASE_PORT "$base" 1 $(( MAX_SERVER_PORT - gpus / tp + 1 ))
    mem=${ROLLOUT_MEM_FRACTION:-0.85}
    [[ "$mem" =~ ^0?\.[0-9]+$ ]] || die "ROLLOUT_MEM_FRACTION must be a fraction in (0, 1), got '$mem'"
    dtype=$(rollout_dtype)
    host=$(bind_address "${ROLLOUT_HOST:-127.0.0.1}")
    if [[ "$host" == 0.0.0.0 || "$host" == "::" ]] && [[ -z "${SGLANG_API_KEY:-}" ]]; then
        echo "disaggregated.sh: warning: servers bind to every interface ($host) without" \
             "SGLANG_API_KEY: anyone who reaches their ports can load weights into them" >&2
    fi
    local extra=() auth=()
    if [[ -n "${SGLANG_EXTRA_ARGS:-}" ]]; then
        read -r -a extra <<< "$SGLANG_EXTRA_ARGS"
    fi
    if [[ -n "${SGLANG_API_KEY:-}" ]]; then
        # SGLang takes the key only as an argument (visible in this node's process list).
        auth=(--api-key "$SGLANG_API_KEY")
    fi
    if (( ! dry_run )); then
        [[ -d "$model" ]] || die "MODEL_DIR is not a directory: $model"
    fi

    # docker/Dockerfile sets CUDA_DEVICE_MAX_CONNECTIONS=1 for Megatron (the learner); it
    # serialises a server's kernels (rollout/sglang/launch.py drops it for the servers the
    # learner launches, LEARNER_ONLY_ENV), so the servers started here do not get it either.
    unset CUDA_DEVICE_MAX_CONNECTIONS
    local n=$(( gpus / tp )) i pids=() name
    name=$(hostname -s 2>/dev/null || hostname)
    # Servers die with this script (the learner's job step ending, Ctrl-C, or one server failing).
    trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
    for (( i = 0; i < n; i++ )); do
        local cmd=(
            "${PYTHON:-python3}" -m "${SGLANG_SERVER_MODULE:-sglang.launch_server}"
            --model-path "$model"
            --host "$host"
            --port "$(( base + i ))"
            --tp-size "$tp"
            --base-gpu-id "$(( i * tp ))"
            --mem-fraction-static "$mem"
            --dtype "$dtype"
            "${extra[@]}"
        )
        if (( dry_run )); then
            # The key itself is never printed.
            printf '%q ' "${cmd[@]}" ${auth[@]+--api-key '<SGLANG_API_KEY>'}
            echo
            continue
        fi
        cmd+=("${auth[@]}")
        if [[ -n "${LOG_DIR:-}" ]]; then
            mkdir -p "$LOG_DIR"
            "${cmd[@]}" > "$LOG_DIR/sglang_${name}_$i.log" 2>&1 &
        else
            "${cmd[@]}" &
        fi
        pids+=("$!")
        echo "disaggregated.sh: server $i on GPUs $(( i * tp ))..$(( i * tp + tp - 1 )):" \
             "http://$name:$(( base + i ))" >&2
    done
    (( dry_run )) && exit 0
    # Stay up while every server is up; the first one to exit ends the node's serving.
    local rc=0
    wait -n "${pids[@]}" || rc=$?
    echo "disaggregated.sh: an SGLang server exited (status $rc); stopping the others" >&2
    exit "$(( rc == 0 ? 1 : rc ))"
}

case "$role" in
    learner) run_learner "$@" ;;
    rollout) run_rollout "$@" ;;
    *) die "unknown role '$role'; $usage" ;;
esac

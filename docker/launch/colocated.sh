#!/usr/bin/env bash
# Colocated rollouts: SGLang servers share the learner's GPUs. The trainer launches the servers
# with memory saving on; they release their weights and KV cache while the learner trains and
# take them back for the next rollout. Every GPU of the job both generates and trains.
#
# Usage: colocated.sh [--dry-run] CONFIG.yaml [--run-dir DIR] [section.key=value ...]
#
# Environment (besides torchrun.sh's NNODES, NODE_RANK, GPUS_PER_NODE, MASTER_ADDR, MASTER_PORT):
#   ROLLOUT_TP            tensor-parallel size of each SGLang server      (default 1)
#   ROLLOUT_MEM_FRACTION  SGLang --mem-fraction-static while generating   (default 0.5)
#   SGLANG_API_KEY        when set, the launched servers require it and the learner sends it
#                         (rollout.api_key_env=SGLANG_API_KEY; the key stays in the environment)
#   ROLLOUT_HOST          address this node's servers bind to: with NNODES > 1 default "internal"
#                         (the address this node's hostname resolves to, which rank 0 on node 0
#                         reaches), or a literal address; with one node rollout.host (127.0.0.1
#                         unless the config says otherwise) unless set
# One server per ROLLOUT_TP GPUs of every node: rollout.num_servers = GPUS_PER_NODE / ROLLOUT_TP
# servers per node. Each node's local rank 0 launches its node's servers, releases and resumes
# their memory around training and pushes them the weights of the learner ranks on the same node
# (CUDA IPC, never across nodes); the learner's rank 0 spreads generation over all nodes' servers.
# Overrides given on the command line win over the ones this script sets.
set -euo pipefail
here=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=docker/launch/common.sh
source "$here/common.sh"

dry=()
if [[ "${1:-}" == "--dry-run" ]]; then
    dry=(--dry-run)
    shift
fi
(( $# >= 1 )) || die "usage: colocated.sh [--dry-run] CONFIG.yaml [--run-dir DIR] [key=value ...]"
config=$1
shift
split_train_args "$@"

nnodes=${NNODES:-1}
require_int NNODES "$nnodes" 1
gpus=$(gpus_per_node)
tp=${ROLLOUT_TP:-1}
require_int ROLLOUT_TP "$tp" 1 "$gpus"
(( gpus % tp == 0 )) || die "ROLLOUT_TP=$tp must divide GPUS_PER_NODE=$gpus"
mem=${ROLLOUT_MEM_FRACTION:-0.5}
[[ "$mem" =~ ^0?\.[0-9]+$ ]] || die "ROLLOUT_MEM_FRACTION must be a fraction in (0, 1), got '$mem'"

host=()
if (( nnodes > 1 )) || [[ -n "${ROLLOUT_HOST:-}" ]]; then
    addr=$(bind_address "${ROLLOUT_HOST:-internal}")
    host=("rollout.host=$addr")
    if [[ "$addr" == 0.0.0.0 || "$addr" == "::" ]] && [[ -z "${SGLANG_API_KEY:-}" ]]; then
        echo "colocated.sh: warning: servers bind to every interface ($addr) without" \
             "SGLANG_API_KEY" >&2
    fi
fi
if (( nnodes > 1 )); then
    echo "colocated.sh: node ${NODE_RANK:-0} of $nnodes: $(( gpus / tp )) rollout servers on" \
         "this node's $gpus GPUs at ${host[0]#rollout.host=}" >&2
fi
auth=()
if [[ -n "${SGLANG_API_KEY:-}" ]]; then
    auth=(rollout.api_key_env=SGLANG_API_KEY)
fi
export GPUS_PER_NODE=$gpus
exec "$here/torchrun.sh" "${dry[@]}" "$config" "${RUN_DIR_ARGS[@]}" \
    rollout.engine=sglang \
    rollout.colocate=true \
    "rollout.tp_size=$tp" \
    "rollout.num_servers=$(( gpus / tp ))" \
    "rollout.mem_fraction=$mem" \
    "${host[@]}" \
    "${auth[@]}" \
    "${OVERRIDE_ARGS[@]}"

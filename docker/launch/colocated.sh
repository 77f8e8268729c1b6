#!/usr/bin/env bash
# Colocated rollouts: SGLang servers share the learner's GPUs. The trainer launches the servers
# with memory saving on; they release their weights and KV cache while the learner trains and
# take them back for the next rollout. Every GPU of the job both generates and trains.
#
# Usage: colocated.sh [--dry-run] [--skip-plan] CONFIG.yaml [--run-dir DIR] [section.key=value ...]
#
# The config's rollout section is the layout that runs (rollout.num_servers servers of
# rollout.tp_size GPUs on every node, rollout.mem_fraction, rollout.host, ...); this script adds
# rollout.engine=sglang and rollout.colocate=true, and sets another field only when its
# variable below is set. Environment (besides torchrun.sh's NNODES, NODE_RANK, GPUS_PER_NODE,
# MASTER_ADDR, MASTER_PORT, GPU_MEMORY, MODEL_CONFIG, SKIP_PLAN):
#   ROLLOUT_TP            rollout.tp_size; and, unless ROLLOUT_NUM_SERVERS is set,
#                         rollout.num_servers = GPUS_PER_NODE / ROLLOUT_TP (one server per
#                         ROLLOUT_TP GPUs of every node)
#   ROLLOUT_NUM_SERVERS   rollout.num_servers (servers per node)
#   ROLLOUT_MEM_FRACTION  rollout.mem_fraction (SGLang --mem-fraction-static while generating)
#   ROLLOUT_HOST          rollout.host: "internal" (each node's cluster-internal address: the one
#                         its hostname resolves to, which rank 0 on node 0 reaches) or a literal
#                         address. With NNODES > 1 the servers must not bind to loopback: the
#                         plan refuses rollout.host=127.0.0.1 there (the shipped multi-node
#                         configs say host: internal).
#   SGLANG_API_KEY        when set, the launched servers require it and the learner sends it
#                         (rollout.api_key_env=SGLANG_API_KEY; the key stays in the environment)
# Each node's local rank 0 launches its node's servers, releases and resumes their memory
# around training and pushes them the weights of the learner ranks on the same node (CUDA IPC,
# never across nodes); the learner's rank 0 spreads generation over all nodes' servers.
# Overrides given on the command line win over the ones this script sets. torchrun.sh runs the
# memory plan on the resulting command before torchrun starts (--dry-run prints it).
set -euo pipefail
here=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=docker/launch/common.sh
source "$here/common.sh"

opts=()
while (( $# )); do
    case "$1" in
        --dry-run|--skip-plan) opts+=("$1"); shift ;;
        *) break ;;
    esac
done
(( $# >= 1 )) || die "usage: colocated.sh [--dry-run] [--skip-plan] CONFIG.yaml [--run-dir DIR] [key=value ...]"
config=$1
shift
split_train_args "$@"

nnodes=${NNODES:-1}
require_int NNODES "$nnodes" 1
gpus=$(gpus_per_node)
layout=()
if [[ -n "${ROLLOUT_TP:-}" ]]; then
    require_int ROLLOUT_TP "$ROLLOUT_TP" 1 "$gpus"
    layout+=("rollout.tp_size=$ROLLOUT_TP")
    if [[ -z "${ROLLOUT_NUM_SERVERS:-}" ]]; then
        (( gpus % ROLLOUT_TP == 0 )) || die "ROLLOUT_TP=$ROLLOUT_TP must divide GPUS_PER_NODE=$gpus (or set ROLLOUT_NUM_SERVERS)"
        layout+=("rollout.num_servers=$(( gpus / ROLLOUT_TP ))")
    fi
fi
if [[ -n "${ROLLOUT_NUM_SERVERS:-}" ]]; then
    require_int ROLLOUT_NUM_SERVERS "$ROLLOUT_NUM_SERVERS" 1 "$gpus"
    layout+=("rollout.num_servers=$ROLLOUT_NUM_SERVERS")
fi
if [[ -n "${ROLLOUT_MEM_FRACTION:-}" ]]; then
    [[ "$ROLLOUT_MEM_FRACTION" =~ ^0?\.[0-9]+$ ]] \
        || die "ROLLOUT_MEM_FRACTION must be a fraction in (0, 1), got '$ROLLOUT_MEM_FRACTION'"
    layout+=("rollout.mem_fraction=$ROLLOUT_MEM_FRACTION")
fi
if [[ -n "${ROLLOUT_HOST:-}" ]]; then
    [[ "$ROLLOUT_HOST" != *[[:space:]]* ]] || die "ROLLOUT_HOST: bad address '$ROLLOUT_HOST'"
    layout+=("rollout.host=$ROLLOUT_HOST")
    if [[ "$ROLLOUT_HOST" == 0.0.0.0 || "$ROLLOUT_HOST" == "::" ]] && [[ -z "${SGLANG_API_KEY:-}" ]]; then
        echo "colocated.sh: warning: servers bind to every interface ($ROLLOUT_HOST) without" \
             "SGLANG_API_KEY" >&2
    fi
fi
auth=()
if [[ -n "${SGLANG_API_KEY:-}" ]]; then
    auth=(rollout.api_key_env=SGLANG_API_KEY)
fi
export GPUS_PER_NODE=$gpus
exec "$here/torchrun.sh" "${opts[@]}" "$config" "${RUN_DIR_ARGS[@]}" \
    rollout.engine=sglang \
    rollout.colocate=true \
    "${layout[@]}" \
    "${auth[@]}" \
    "${OVERRIDE_ARGS[@]}"

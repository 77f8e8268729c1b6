#!/usr/bin/env bash
# Multi-node launch of `megatron-gspo train` with torchrun (static rendezvous at MASTER_ADDR).
#
# Usage: torchrun.sh [--dry-run] CONFIG.yaml [--run-dir DIR] [section.key=value ...]
#
# Run the same command on every node; only NODE_RANK differs. Environment:
#   NNODES         number of nodes                                (default 1)
#   NODE_RANK      this node's rank, 0 .. NNODES-1                (default 0)
#   GPUS_PER_NODE  processes (GPUs) per node                      (default: GPUs nvidia-smi lists)
#   MASTER_ADDR    address of node 0, reachable from every node   (required when NNODES > 1)
#   MASTER_PORT    rendezvous port on node 0                      (default 29500)
#   MAX_RESTARTS   torchrun --max-restarts: a dead rank restarts this node's worker group,
#                  which resumes from the newest complete checkpoint by itself  (default 3; 0: off)
#   MONITOR_INTERVAL  seconds between torchrun's checks of its workers         (default 5)
#   LOG_DIR        if set, torchrun also writes every rank's output under LOG_DIR/node<RANK>
#   TORCHRUN       torchrun executable                            (default torchrun)
#   MEGATRON_GSPO  the CLI executable                             (default megatron-gspo)
# --dry-run prints the torchrun command line (shell-quoted, one line) and exits.
set -euo pipefail
# shellcheck source=docker/launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then
    dry_run=1
    shift
fi
(( $# >= 1 )) || die "usage: torchrun.sh [--dry-run] CONFIG.yaml [--run-dir DIR] [key=value ...]"
config=$1
shift
[[ "$config" != -* ]] || die "first argument must be the config file, got '$config'"

nnodes=${NNODES:-1}
node_rank=${NODE_RANK:-0}
master_port=${MASTER_PORT:-29500}
max_restarts=${MAX_RESTARTS:-3}
monitor_interval=${MONITOR_INTERVAL:-5}
require_int NNODES "$nnodes" 1
require_int NODE_RANK "$node_rank" 0 $((nnodes - 1))
require_int MASTER_PORT "$master_port" 1 65535
require_int MAX_RESTARTS "$max_restarts" 0
require_int MONITOR_INTERVAL "$monitor_interval" 1
gpus=$(gpus_per_node)

if (( nnodes > 1 )); then
    [[ -n "${MASTER_ADDR:-}" ]] || die "MASTER_ADDR (address of node 0) is required when NNODES > 1"
    master_addr=$MASTER_ADDR
else
    master_addr=${MASTER_ADDR:-127.0.0.1}
fi

cmd=(
    "${TORCHRUN:-torchrun}"
    "--nnodes=$nnodes"
    "--node-rank=$node_rank"
    "--nproc-per-node=$gpus"
    "--master-addr=$master_addr"
    "--master-port=$master_port"
    "--max-restarts=$max_restarts"
    "--monitor-interval=$monitor_interval"
)
if [[ -n "${LOG_DIR:-}" ]]; then
    cmd+=("--log-dir=$LOG_DIR/node$node_rank" "--tee=3")
fi
cmd+=(--no-python "${MEGATRON_GSPO:-megatron-gspo}" train "$config" "$@")

if (( dry_run )); then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi

[[ -f "$config" ]] || die "config file not found: $config"
# One hardware queue per device keeps tensor-parallel communication ordered with compute.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
echo "torchrun.sh: node $node_rank of $nnodes, $gpus GPUs, master $master_addr:$master_port" >&2
exec "${cmd[@]}"

#!/usr/bin/env bash
# Multi-node launch of `megatron-gspo train` with torchrun (static rendezvous at MASTER_ADDR).
#
# Usage: torchrun.sh [--dry-run] [--skip-plan] CONFIG.yaml [--run-dir DIR] [section.key=value ...]
#
# Run the same command on every node; only NODE_RANK differs. Environment:
#   NNODES         number of nodes                                (default 1)
#   NODE_RANK      this node's rank, 0 .. NNODES-1                (default 0)
#   GPUS_PER_NODE  processes (GPUs) per node                      (default: GPUs nvidia-smi lists)
#   MASTER_ADDR    address of node 0, reachable from every node   (required when NNODES > 1)
#   MASTER_PORT    rendezvous port on node 0                      (default 29500)
#   MAX_RESTARTS   torchrun --max-restarts: a dead rank restarts this node's worker group,
#                  which resumes from the newest complete checkpoint by itself  (default 3; 0: off);
#                  above 0 the run needs checkpoint.interval > 0 (refused at start otherwise)
#   MONITOR_INTERVAL  seconds between torchrun's checks of its workers         (default 5)
#   LOG_DIR        if set, torchrun also writes every rank's output under LOG_DIR/node<RANK>
#   TORCHRUN       torchrun executable                            (default torchrun)
#   MEGATRON_GSPO  the CLI executable                             (default megatron-gspo)
#   GPU_MEMORY     memory of one GPU for the plan, e.g. 80GiB     (default: the smallest GPU
#                  nvidia-smi lists; without either the plan checks the layout, not the memory)
#   MODEL_CONFIG   the model's config.json (or its directory) for the plan (default: model.path)
#   SKIP_PLAN=1    same as --skip-plan
# The config is the one source of truth for the layout: this script adds no override of its
# own. Before torchrun starts, `megatron-gspo plan --brief` runs on this exact command (the
# config and overrides, NNODES x GPUS_PER_NODE GPUs): a layout that does not fit the GPUs' memory,
# or that the trainer would refuse at start, stops here with one line naming the changes
# checked that fit (--skip-plan launches anyway). --dry-run prints the torchrun command line
# (shell-quoted, one line), then the plan's lines (the resolved rollout layout, the learner
# layout, the verdict) as comments, and exits with the plan's status.
set -euo pipefail
# shellcheck source=docker/launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

dry_run=0
while (( $# )); do
    case "$1" in
        --dry-run) dry_run=1; shift ;;
        --skip-plan) export SKIP_PLAN=1; shift ;;
        *) break ;;
    esac
done
(( $# >= 1 )) || die "usage: torchrun.sh [--dry-run] [--skip-plan] CONFIG.yaml [--run-dir DIR] [key=value ...]"
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

plan_lines=()
plan_rc=0
if [[ "${SKIP_PLAN:-0}" != 1 ]]; then
    split_train_args "$@"
    run_plan "$config" "$nnodes" "$gpus"
fi

if (( dry_run )); then
    printf '%q ' "${cmd[@]}"
    echo
    for line in "${plan_lines[@]}"; do echo "# $line"; done
    exit "$plan_rc"
fi

[[ -f "$config" ]] || die "config file not found: $config"
if (( plan_rc != 0 )); then
    die "$(plan_refusal) (--skip-plan or SKIP_PLAN=1 launches anyway)"
fi
for line in "${plan_lines[@]}"; do echo "torchrun.sh: $line" >&2; done
# One hardware queue per device keeps tensor-parallel communication ordered with compute.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
echo "torchrun.sh: node $node_rank of $nnodes, $gpus GPUs, master $master_addr:$master_port" >&2
exec "${cmd[@]}"

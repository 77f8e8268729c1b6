#!/usr/bin/env bash
# The docker tier (CI, after the other tiers; docker/README.md): the CPU image built from
# scratch and run.
#   1. docker.io and debootstrap from Debian's packages when missing (root, apt)
#   2. a private dockerd (own data root under the ignored .docker-tier/, own socket, no bridge
#      network: containers use the host network or none), stopped at the end whatever happens
#   3. docker/build.sh cpu: wheelhouse from docker/lock/cpu.txt, debootstrap'd bookworm base,
#      the image (its last build step is the self-check)
#   4. the self-check again in a container (--network none)
#   5. the tiny demo inside a container for a few steps (--network none)
#   6. two containers on the host network as node ranks 0 and 1 of one torchrun job
#      (docker/launch/colocated.sh: rendezvous on 127.0.0.1, the learner over both, stand-in
#      SGLang servers colocated on each node), checkpoints written to a docker volume; then two
#      fresh containers resume the job from that volume
#   7. no container, volume or network of ours may remain (docker ps -a / network ls /
#      volume ls printed); dockerd stops, its data root (images, build cache) is removed
# Prints each step's time and the tier's; exit code 1 when a step failed, naming it.
# Environment: DOCKER_TIER_STEPS (demo steps, default 3), DOCKER_TIER_KEEP=1 keeps .docker-tier.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
tier_start=$(date +%s)
work=$root/.docker-tier
id=mgspo-tier-$$
sock=/run/$id.sock
export DOCKER_HOST=unix://$sock
export DOCKER=/usr/bin/docker  # Debian's client: BuildKit without the buildx plugin
image=megatron-gspo:tier-cpu
volume=$id-runs
step=""
dockerd_pid=""

say() { echo "docker_tier: $*" >&2; }
start_step() {
    step=$1
    step_start=$(date +%s)
    say "== step $step"
}
end_step() { say "step $step: $(( $(date +%s) - step_start )) s"; }

# ours: containers, volumes, networks of this tier that still exist (one per line).
ours() {
    "$DOCKER" ps -a --filter "name=$id" --format 'container {{.Names}}'
    "$DOCKER" volume ls --filter "name=$id" --format 'volume {{.Name}}'
    "$DOCKER" network ls --filter "name=$id" --format 'network {{.Name}}'
}

finish() {
    local rc=$? left=""
    trap - EXIT
    if (( rc != 0 )) && [[ -n "$step" ]]; then
        say "FAILED at step: $step (exit $rc)"
    fi
    if [[ -n "$dockerd_pid" ]] && kill -0 "$dockerd_pid" 2>/dev/null; then
        # Whatever a failed step left running is removed, then listed (must be empty).
        "$DOCKER" ps -aq --filter "name=$id" | xargs -r "$DOCKER" rm -f >/dev/null 2>&1 || true
        "$DOCKER" volume rm "$volume" >/dev/null 2>&1 || true
        echo "--- docker ps -a"; "$DOCKER" ps -a
        echo "--- docker network ls"; "$DOCKER" network ls
        echo "--- docker volume ls"; "$DOCKER" volume ls
        left=$(ours)
        "$DOCKER" rmi -f "$image" megatron-gspo-base:bookworm >/dev/null 2>&1 || true
        kill "$dockerd_pid"
        wait "$dockerd_pid" 2>/dev/null || true
        say "dockerd stopped"
    fi
    # dockerd leaves its network namespace mounted in its exec root.
    if grep -q " /run/$id/netns/default " /proc/mounts; then
        umount "/run/$id/netns/default" || true
    fi
    rm -rf "/run/$id" "/run/$id.pid" "$sock"
    if [[ -n "$left" ]]; then
        say "left behind: $left"
        rc=1
    fi
    if [[ "${DOCKER_TIER_KEEP:-0}" != 1 ]]; then
        rm -rf "$work/data-root"  # the images and the build cache with it
    fi
    say "tier exit code $rc after $(( $(date +%s) - tier_start )) s"
    exit "$rc"
}
trap finish EXIT

# ---- 1. packages
start_step "1 docker.io and debootstrap"
if ! command -v dockerd >/dev/null || [[ ! -x /usr/bin/docker ]] || ! command -v debootstrap >/dev/null; then
    [[ "$(id -u)" == 0 ]] || { say "needs root to install docker.io and debootstrap"; exit 1; }
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
fi
say "$(/usr/bin/docker --version)"
end_step

# ---- 2. dockerd
start_step "2 dockerd (private: $sock)"
rm -rf "$work/data-root"
mkdir -p "$work"
dockerd --data-root "$work/data-root" --exec-root "/run/$id" --host "$DOCKER_HOST" \
    --pidfile "/run/$id.pid" --bridge=none --iptables=false --ip6tables=false \
    > "$work/dockerd.log" 2>&1 &
dockerd_pid=$!
for _ in $(seq 1 60); do
    "$DOCKER" info >/dev/null 2>&1 && break
    kill -0 "$dockerd_pid" 2>/dev/null || { tail -n 20 "$work/dockerd.log" >&2; exit 1; }
    sleep 1
done
"$DOCKER" info >/dev/null
end_step

# ---- 3. the CPU image from scratch
start_step "3 build the CPU image (docker/build.sh cpu)"
BUILD_LOG=$work/build-cpu.log docker/build.sh cpu --tag "$image"
size=$("$DOCKER" image inspect -f '{{.Size}}' "$image")
end_step
say "image $image: $(( size / 1000000 )) MB"

run() { "$DOCKER" run --rm --shm-size=1g --label "$id" "$@"; }

# ---- 4. self-check
start_step "4 self-check in a container"
run --name "$id-selfcheck" --network none "$image" python3 docker/selfcheck.py
end_step

# ---- 5. the tiny demo
start_step "5 tiny demo inside (${DOCKER_TIER_STEPS:-3} steps)"
run --name "$id-demo" --network none -e OMP_NUM_THREADS=2 "$image" bash -c \
    "megatron-gspo train examples/tiny/config.yaml --run-dir /tmp/demo \
     train.max_steps=${DOCKER_TIER_STEPS:-3} train.eval_interval=0 logging.progress_bar=false \
     logging.tensorboard=false >/tmp/demo.log 2>&1 || { tail -n 40 /tmp/demo.log; exit 1; }; \
     python3 docker/run_summary.py /tmp/demo --steps ${DOCKER_TIER_STEPS:-3}"
end_step

# ---- 6. two containers, two nodes; then resumed by fresh containers
port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
SMALL=(train.prompts_per_step=4 rollout.group_size=4 rollout.max_new_tokens=6
       algorithm.mini_batches=2 train.eval_interval=0 logging.progress_bar=false
       logging.tensorboard=false logging.log_samples=0 checkpoint.interval=2
       rollout.startup_timeout=240)
# job STEPS: node ranks 0 and 1 as two containers on the host network; both must exit 0.
job() {
    local steps=$1 master base rank rc=0
    master=$(port)
    base=$(( 40000 + RANDOM % 10000 ))
    for rank in 0 1; do
        "$DOCKER" run -d --shm-size=1g --label "$id" --name "$id-node$rank" --network host \
            -v "$volume:/runs" -e NNODES=2 -e "NODE_RANK=$rank" -e GPUS_PER_NODE=1 \
            -e MASTER_ADDR=127.0.0.1 -e "MASTER_PORT=$master" -e MAX_RESTARTS=0 \
            -e ROLLOUT_HOST=127.0.0.1 -e OMP_NUM_THREADS=1 -e PYTHONWARNINGS=ignore \
            -e SGLANG_SERVER_MODULE=megatron_gspo.rollout.standin.server \
            "$image" colocated.sh examples/tiny/config.yaml --run-dir /runs/job \
            "${SMALL[@]}" "rollout.base_port=$base" "train.max_steps=$steps" >/dev/null
    done
    for rank in 0 1; do
        local code
        code=$("$DOCKER" wait "$id-node$rank")
        if [[ "$code" != 0 ]]; then
            say "node $rank exited $code; its last output:"
            "$DOCKER" logs --tail 40 "$id-node$rank" >&2 || true
            rc=1
        fi
    done
    "$DOCKER" logs "$id-node0" 2>&1 | grep -E "colocated.sh|torchrun.sh" >&2 || true
    "$DOCKER" rm "$id-node0" "$id-node1" >/dev/null
    return "$rc"
}
start_step "6a two-container job (node ranks 0 and 1, 4 steps, checkpoints every 2)"
"$DOCKER" volume create "$volume" >/dev/null
job 4
run --name "$id-summary" --network none -v "$volume:/runs" "$image" \
    python3 docker/run_summary.py /runs/job --steps 4 --world 2 --checkpoint 4
end_step
start_step "6b fresh containers resume the job from the volume (to step 6)"
job 6
run --name "$id-summary" --network none -v "$volume:/runs" "$image" \
    python3 docker/run_summary.py /runs/job --steps 6 --world 2 --checkpoint 6 --resumed-at 4
"$DOCKER" volume rm "$volume" >/dev/null
end_step

# ---- 7. nothing of ours left (checked in finish, after the listing)
step=""
say "all steps passed"

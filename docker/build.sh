#!/usr/bin/env bash
# Build the megatron-gspo image: gather the wheelhouse from the lock file, then `docker build`.
#
# Usage: docker/build.sh cpu|gpu [--base IMAGE] [--tag TAG] [--wheelhouse-only] [-- DOCKER_ARGS]
#
#   1. wheelhouse  pip downloads exactly the files of docker/lock/<flavour>.txt (hash-checked)
#                  into .docker-wheelhouse/<flavour>/ (kept between builds: files already there
#                  are not fetched again; files the lock does not name are removed)
#   2. base image  cpu only, when --base is not given: megatron-gspo-base:bookworm, made once by
#                  debootstrap (--variant=minbase, with python3 and python3-venv; needs root) and
#                  `docker import` unless it exists
#   3. image       DOCKER_BUILDKIT=1 docker build --network host -f docker/Dockerfile
#                  --build-arg FLAVOR=<flavour> [--build-arg BASE_IMAGE=...]: no package index
#                  is reached for Python packages; the last step is the image's self-check
# A failing step is named on stderr (for the image: the Dockerfile step BuildKit reports).
# Environment: DOCKER (client, default docker; needs BuildKit: buildx, or a 20.10-22 client),
# PYTHON (pip for the wheelhouse, default python3), SDIST_PYTHON (gpu: a Python with torch and
# wheel, to download the Transformer Engine binding's sdist; default PYTHON), BUILD_LOG (file
# for the docker build output, default .docker-wheelhouse/build-<flavour>.log).
# Outside this project's machines torch's CPU wheel comes from PyTorch's index:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu docker/build.sh cpu
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

die() { echo "build.sh: $*" >&2; exit 2; }
step=""
start_step() { step=$1; echo "== build.sh: step $step" >&2; }
finish() {
    local rc=$?
    if (( rc != 0 )) && [[ -n "$step" ]]; then
        echo "build.sh: FAILED at step: $step (exit $rc)" >&2
    fi
}
trap finish EXIT

flavor=${1:-}
[[ "$flavor" == cpu || "$flavor" == gpu ]] || die "usage: build.sh cpu|gpu [--base IMAGE] [--tag TAG] [--wheelhouse-only] [-- DOCKER_ARGS]"
shift
base="" tag="" wheelhouse_only=0 extra=()
while (( $# )); do
    case "$1" in
        --base) [[ $# -ge 2 && -n "$2" ]] || die "--base needs an image name"; base=$2; shift 2 ;;
        --tag) [[ $# -ge 2 && -n "$2" ]] || die "--tag needs a name"; tag=$2; shift 2 ;;
        --wheelhouse-only) wheelhouse_only=1; shift ;;
        --) shift; extra=("$@"); break ;;
        *) die "unknown argument '$1'" ;;
    esac
done
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
tag=${tag:-megatron-gspo:${version}-${flavor}}
lock=docker/lock/$flavor.txt
wheels=.docker-wheelhouse/$flavor
DOCKER=${DOCKER:-docker}
PYTHON=${PYTHON:-python3}
BUILD_LOG=${BUILD_LOG:-.docker-wheelhouse/build-$flavor.log}
[[ -f "$lock" ]] || die "no lock file $lock (python docker/lock.py $flavor)"

# The docker client and its daemon, checked before anything is downloaded or made as root.
check_docker() {
    command -v "$DOCKER" >/dev/null 2>&1 \
        || die "docker client '$DOCKER' not found (install docker, or set DOCKER to its path)"
    local out
    if ! out=$("$DOCKER" version -f '{{.Server.Version}}' 2>&1); then
        out=$(printf '%s' "$out" | grep -v '^[[:space:]]*$' | tail -n 1 || true)
        die "docker daemon not reachable through '$DOCKER' (${out:-no answer}); start it, or" \
            "run as a user allowed on its socket"
    fi
}
(( wheelhouse_only )) || check_docker

# ---- 1. wheelhouse
start_step "1 wheelhouse ($lock -> $wheels)"
t0=$(date +%s)
"$PYTHON" docker/lock.py "$flavor" --fetch "$wheels"
echo "build.sh: wheelhouse $wheels: $(find "$wheels" -maxdepth 1 -type f | wc -l) files," \
     "$(du -sh "$wheels" | cut -f1), $(( $(date +%s) - t0 )) s" >&2
if (( wheelhouse_only )); then
    step=""
    exit 0
fi

# ---- 2. base image (cpu)
if [[ "$DOCKER" == docker ]] && ! docker buildx version >/dev/null 2>&1; then
    major=$(docker version -f '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)
    if [[ -n "$major" ]] && (( major >= 23 )) && [[ -x /usr/bin/docker ]]; then
        DOCKER=/usr/bin/docker  # a 23+ client builds with BuildKit only through buildx
    fi
fi
build_args=(--build-arg "FLAVOR=$flavor")
if [[ "$flavor" == cpu && -z "$base" ]]; then
    base=megatron-gspo-base:bookworm
    start_step "2 base image ($base)"
    if ! "$DOCKER" image inspect "$base" >/dev/null 2>&1; then
        command -v debootstrap >/dev/null || die "debootstrap not installed (apt-get install -y debootstrap)"
        (( EUID == 0 )) || die "making the base image $base runs debootstrap, which needs root;" \
            "run as root or pass --base IMAGE"
        t0=$(date +%s)
        root=$(mktemp -d)
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            bookworm "$root" http://deb.debian.org/debian >/dev/null
        tar -C "$root" -c . | "$DOCKER" import - "$base" >/dev/null
        rm -rf "$root"
        echo "build.sh: base image $base made in $(( $(date +%s) - t0 )) s" >&2
    fi
fi
[[ -z "$base" ]] || build_args+=(--build-arg "BASE_IMAGE=$base")

# ---- 3. the image
start_step "3 docker build ($tag)"
t0=$(date +%s)
set +e
DOCKER_BUILDKIT=1 "$DOCKER" build --network host --progress plain -f docker/Dockerfile \
    "${build_args[@]}" "${extra[@]}" -t "$tag" . > "$BUILD_LOG" 2>&1
rc=$?
set -e
if (( rc != 0 )); then
    tail -n 30 "$BUILD_LOG" >&2
    failed=$(grep -E '^ > \[' "$BUILD_LOG" | tail -n 1 | sed 's/^ > //')
    [[ -n "$failed" ]] || failed=$(grep -E '^#[0-9]+ \[' "$BUILD_LOG" | tail -n 1)
    step="3 docker build, Dockerfile step ${failed:-unknown} (log: $BUILD_LOG)"
    exit "$rc"
fi
size=$("$DOCKER" image inspect -f '{{.Size}}' "$tag")
echo "build.sh: built $tag in $(( $(date +%s) - t0 )) s, $(( size / 1000000 )) MB (log: $BUILD_LOG)" >&2
step=""

#!/usr/bin/env bash
# Prepare, on a CPU machine with package-registry access, the kit folder that travels with the
# working tree to a GPU machine without network for scripts/gpu_checks.sh:
#   - the wheels listed in scripts/gpu_wheels.txt (CPython 3.12, manylinux x86-64, no
#     dependencies: the GPU machine has them), replacing any older wheels in the folder;
#   - learner_ref/ref.pt: the CPU reference of scripts/gpu_learner_check.py (the GPU machine's
#     torch may be too old for the CPU layer that makes it).
# Prints the kit's total size, and the size with the tracked working tree, against the 64 MiB
# that may travel. Exit status 1 when the kit is over that limit.
#
# Usage: scripts/gpu_wheels.sh [KIT_DIR]          (default: .whl in the repository root)
# Environment: PYTHON (default: .venv/bin/python if present, else python3),
#              NO_REFERENCE=1 to skip the learner reference.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
kit=${1:-$root/.whl}
limit_mib=64
if [[ -n "${PYTHON:-}" ]]; then
    py=$PYTHON
elif [[ -x "$root/.venv/bin/python" ]]; then
    py=$root/.venv/bin/python
else
    py=python3
fi

mapfile -t pins < <(grep -v -E '^\s*(#|$)' "$root/scripts/gpu_wheels.txt")
(( ${#pins[@]} )) || { echo "gpu_wheels.sh: scripts/gpu_wheels.txt lists no package" >&2; exit 2; }

mkdir -p "$kit"
fresh=$(mktemp -d)
trap 'rm -rf "$fresh"' EXIT
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$fresh" "${pins[@]}"
# One version of each package: the kit's wheels are exactly this download.
rm -f "$kit"/*.whl
mv "$fresh"/*.whl "$kit"/

if [[ "${NO_REFERENCE:-0}" != 1 ]]; then
    rm -rf "$kit/learner_ref"
    if ! "$py" "$root/scripts/gpu_learner_check.py" --reference-only --out "$fresh/ref" \
            > "$fresh/ref.log" 2>&1; then
        echo "gpu_wheels.sh: the learner reference run failed:" >&2
        tail -n 40 "$fresh/ref.log" >&2
        exit 1
    fi
    mkdir -p "$kit/learner_ref"
    cp "$fresh/ref/ref.pt" "$kit/learner_ref/ref.pt"
fi

kit_bytes=$(find "$kit" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
tree_bytes=$(cd "$root" && git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
echo "kit folder: $kit"
find "$kit" -type f -printf '  %P\t%s bytes\n' | sort
echo "kit total: $(mib "$kit_bytes") MiB ($kit_bytes bytes)"
echo "with the tracked working tree ($(mib "$tree_bytes") MiB): $(mib $(( kit_bytes + tree_bytes ))) MiB of the ${limit_mib} MiB that may travel"
if (( kit_bytes + tree_bytes > limit_mib * 1048576 )); then
    echo "gpu_wheels.sh: over the ${limit_mib} MiB limit" >&2
    exit 1
fi

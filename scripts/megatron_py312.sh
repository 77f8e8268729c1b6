#!/usr/bin/env bash
# Install the second test environment: Python 3.12 with the newest Megatron-Core the project
# supports (megatron-core 0.19.2; the registry ships megatron-core for Python 3.11 only up to
# 0.16.1, so the project's .venv can never see a newer one). It goes into an ignored folder of the
# checkout with its own virtual environment (never the project's .venv), for the `mcore_new` test
# tier (README, "Supported versions").
#
# Usage: scripts/megatron_py312.sh [DIR]      DIR default .venv312
# What it installs (all with --no-deps from scripts/megatron_py312/lock.txt):
#   torch from the registry (the Linux wheel is the CUDA build; it imports and runs on a CPU
#   machine), megatron-core 0.19.2, the project's other dependencies and its dev extras; then the
#   project itself, editable, with --no-deps (so pyproject.toml's megatron-core range applies and
#   the lock decides the version).
# A stamp (DIR/.installed) records the sha256 of this script, the lock file and pyproject.toml;
# while all are unchanged the install is skipped.
#
# Without a lock file (or with MEGATRON_PY312_RESOLVE=1) the set is resolved instead: torch at the
# pin below, then the project with its dev extras and megatron-core at the pin below through
# pip's resolver (torch held fixed); the result is written to scripts/megatron_py312/lock.txt.
# Python: $PYTHON312, else python3.12 on PATH, else pyenv's newest 3.12.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
here=$root/scripts/megatron_py312
dir=${1:-$root/.venv312}
lock=$here/lock.txt
torch_pin="torch==2.13.0"
mcore_pin="megatron-core==0.19.2"
stamp=$dir/.installed

say() { echo "megatron_py312: $*" >&2; }

find_python() {
    local cand
    local pyenv_312
    pyenv_312=$(find "${PYENV_ROOT:-$HOME/.pyenv}/versions" -maxdepth 3 -path '*/3.12*/bin/python3.12' \
        2>/dev/null | sort -V -r)
    # shellcheck disable=SC2086  # one path a line, no spaces in pyenv's version folders
    for cand in "${PYTHON312:-}" "$(command -v python3.12 || true)" $pyenv_312; do
        if [ -n "$cand" ] && [ -x "$cand" ] \
            && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
            echo "$cand"
            return 0
        fi
    done
    say "no Python 3.12 found (set PYTHON312, or put python3.12 on PATH)"
    return 1
}

want_stamp() {
    local f sums=""
    for f in "$0" "$lock" "$root/pyproject.toml"; do
        sums="$sums $(sha256sum "$f" | cut -d' ' -f1)"
    done
    echo "$mcore_pin$sums"
}

resolve() {
    say "resolving $torch_pin, $mcore_pin and the project's dependencies (no lock file $lock)"
    "$dir/bin/python" -m pip install "$torch_pin"
    echo "$torch_pin" > "$dir/constraints.txt"
    "$dir/bin/python" -m pip install -c "$dir/constraints.txt" -e "${root}[dev]" "$mcore_pin"
    mkdir -p "$here"
    "$dir/bin/python" -m pip freeze --exclude-editable | grep -v '^pip==' > "$lock.new"
    mv "$lock.new" "$lock"
    say "wrote $lock"
}

check() {
    "$dir/bin/python" -c 'import sys, torch, megatron.core, megatron_gspo
from megatron.core.package_info import __version__ as v
print("python", sys.version.split()[0], "torch", torch.__version__, "megatron-core", v,
      "cuda available:", torch.cuda.is_available())'
}

main() {
    if [ -x "$dir/bin/python" ] && [ -f "$stamp" ] && [ -f "$lock" ] \
        && [ "$(cat "$stamp")" = "$(want_stamp)" ]; then
        say "$dir is set up ($mcore_pin, pins unchanged); install skipped"
    else
        rm -f "$stamp"
        if [ ! -x "$dir/bin/python" ]; then
            local py
            py=$(find_python)
            say "creating $dir with $py"
            "$py" -m venv "$dir"
        fi
        "$dir/bin/python" -m pip install --quiet --upgrade "pip==25.3"
        if [ ! -f "$lock" ] || [ "${MEGATRON_PY312_RESOLVE:-0}" = "1" ]; then
            resolve
        else
            "$dir/bin/python" -m pip install --no-deps -r "$lock"
            "$dir/bin/python" -m pip install --no-deps -e "$root"
        fi
        check
        want_stamp > "$stamp"
    fi
    echo "Python 3.12 with $mcore_pin is installed in $dir. Run its tier with:"
    echo "  scripts/mcore_new_tier.sh"
}

main

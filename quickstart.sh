#!/usr/bin/env bash
# Quick start in two commands, each doing its own set-up when needed:
#   ./quickstart.sh demo [KEY=VALUE ...]   set up .venv, train the tiny CPU demo (examples/tiny)
#   ./quickstart.sh test [PYTEST ARGS ...] set up .venv, run the test suite (python -m pytest)
#   ./quickstart.sh setup                  only the set-up step
# Set-up: create .venv if missing (with $PYTHON, default python3), install torch first (the CPU
# wheel on a CPU-only machine), then the package with its dev extras. A stamp in .venv records
# the sha256 of pyproject.toml and the torch pin; while both are unchanged the install is skipped.
set -euo pipefail
cd "$(dirname "$0")"

VENV=.venv
TORCH_PIN="torch==2.13.0"
STAMP="$VENV/.quickstart-installed"

want_stamp() {
    local sum
    sum=$(sha256sum pyproject.toml | cut -d' ' -f1)
    echo "$TORCH_PIN pyproject.toml:$sum"
}

setup() {
    local want
    want=$(want_stamp)
    if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
        echo "quickstart: $VENV is set up (pyproject.toml unchanged); install skipped" >&2
        return 0
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        local py="${PYTHON:-python3}"
        if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
            echo "quickstart: $py is not Python 3.10 or newer" >&2
            exit 1
        fi
        echo "quickstart: creating $VENV with $py" >&2
        "$py" -m venv "$VENV"
    fi
    rm -f "$STAMP"
    "$VENV/bin/python" -m pip install "$TORCH_PIN"
    "$VENV/bin/python" -m pip install -e ".[dev]"
    echo "$want" > "$STAMP"
}

cmd="${1:-}"
if [ $# -gt 0 ]; then shift; fi
case "$cmd" in
    setup)
        setup
        ;;
    demo)
        setup
        exec "$VENV/bin/megatron-gspo" train examples/tiny/config.yaml "$@"
        ;;
    test)
        setup
        exec "$VENV/bin/python" -m pytest "$@"
        ;;
    *)
        echo "usage: ./quickstart.sh demo|test|setup [ARGS ...]" >&2
        exit 2
        ;;
esac

#!/usr/bin/env bash
# The `mcore_new` test tier in the second environment (README, "Supported versions"): installs
# .venv312 when needed (scripts/megatron_py312.sh: Python 3.12, megatron-core 0.19.2; skipped
# while its pins are unchanged), then runs the tier's tests (tests/conftest.py lists them) there
# and prints the install time, the test count and the wall time. Fails when a test fails, when
# the tier collects nothing or skips a test, or when the environment is not megatron-core 0.19.
# Usage: scripts/mcore_new_tier.sh [PYTEST ARGS ...]       (.ci/run runs it without arguments)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
start=$(date +%s)
scripts/megatron_py312.sh
echo "mcore_new: install took $(( $(date +%s) - start )) s"
junit=$(mktemp)
trap 'rm -f "$junit"' EXIT
start=$(date +%s)
set +e
MEGATRON_GSPO_MCORE_NEW_REQUIRED=1 .venv312/bin/python -m pytest -m mcore_new \
    -p no:cacheprovider --junitxml="$junit" tests/megatron tests/convert "$@"
rc=$?
set -e
read -r ran skipped < <(python3 - "$junit" <<'PY'
import sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("0 0")
    raise SystemExit
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
print(sum(int(x.get("tests", 0)) for x in suites), sum(int(x.get("skipped", 0)) for x in suites))
PY
)
echo "mcore_new: tier (megatron-core 0.19.2): $ran tests, $skipped skipped, exit code $rc," \
    "$(( $(date +%s) - start )) s"
if [ "$rc" -eq 5 ] || [ "$ran" -eq 0 ]; then
    echo "mcore_new: the tier collected no tests" >&2
    exit 1
fi
if [ "$skipped" -ne 0 ]; then
    echo "mcore_new: the tier skipped $skipped tests" >&2
    exit 1
fi
exit "$rc"

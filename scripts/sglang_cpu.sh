#!/usr/bin/env bash
# Install SGLang's real HTTP server for CPU-only machines into an ignored folder of the checkout,
# with its own virtual environment (never the project's .venv), for the `sglang_real` test tier
# (tests/rollout/test_sglang_real_*.py) and for `rollout.sglang_python` runs on a CPU machine.
#
# Usage: scripts/sglang_cpu.sh [VERSION] [DIR]
#   VERSION  SGLang release (default 0.5.12); DIR default .sglang-cpu (0.5.12) or .sglang-cpu-VERSION.
# What it installs:
#   DIR/venv         a venv with the pinned packages of scripts/sglang_cpu/lock-VERSION.txt, all
#                    installed with --no-deps (torch and torchvision are the registry's CUDA builds:
#                    they import and run on a CPU machine; sglang-kernel is the CUDA wheel, whose
#                    Python package the CPU engine imports)
#   DIR/stub/libcuda.so.1
#                    a no-GPU CUDA driver stub (every entry point returns CUDA_ERROR_NO_DEVICE),
#                    built with gcc from scripts/sglang_cpu/libcuda_stub.c, so sglang-kernel's
#                    libraries load; put DIR/stub on LD_LIBRARY_PATH (the launcher does)
# A stamp (DIR/.installed) records the sha256 of this script, the lock file and the stub source;
# while all are unchanged the install is skipped.
#
# A release without a lock file is resolved instead (SGLANG_CPU_RESOLVE=1 forces it): torch,
# torchvision and sglang-kernel at the versions the sglang wheel's metadata pins, then the
# pure-Python packages of its HTTP server (scripts/sglang_cpu/server-packages.txt) with pip's
# resolver, torch held fixed; the result is written to scripts/sglang_cpu/lock-VERSION.txt.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
here=$root/scripts/sglang_cpu
version=${1:-0.5.12}
if [ "$version" = "0.5.12" ]; then
    dir=${2:-$root/.sglang-cpu}
else
    dir=${2:-$root/.sglang-cpu-$version}
fi
lock=$here/lock-$version.txt
stub_src=$here/libcuda_stub.c
py=${PYTHON:-python3}
venv=$dir/venv
stamp=$dir/.installed

say() { echo "sglang_cpu: $*" >&2; }

want_stamp() {
    local f sums=""
    for f in "$0" "$lock" "$stub_src"; do
        sums="$sums $(sha256sum "$f" | cut -d' ' -f1)"
    done
    echo "sglang==$version$sums"
}

# Pins of the sglang wheel's metadata (every unconditional Requires-Dist name==version; torch and
# sglang-kernel must be among them), and the torchvision release of that torch (torch 2.N.P pairs
# with torchvision 0.(N+15).P; sglang leaves torchvision unpinned). One "name==version" a line.
wheel_pins() {
    local tmp rc=0
    tmp=$(mktemp -d)
    "$venv/bin/python" -m pip download --quiet --no-deps -d "$tmp" "sglang==$version"
    "$venv/bin/python" - "$tmp"/sglang-*.whl <<'PY' || rc=$?
import re, sys, zipfile
whl = sys.argv[1]
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
pins = {}
for line in text.splitlines():
    m = re.match(r"Requires-Dist: *([A-Za-z0-9_.-]+) *==([^;,\s]+) *$", line)
    if m:
        pins[m.group(1).lower().replace("_", "-")] = m.group(2)
for name in ("torch", "sglang-kernel"):
    if name not in pins:
        sys.exit(f"{whl}: no == pin for {name} in its metadata")
for name, v in pins.items():
    print(f"{name}=={v}")
major, minor, patch = (int(x) for x in pins["torch"].split("+")[0].split(".")[:3])
print(f"torchvision==0.{minor + 15}.{patch}" if major == 2 else sys.exit("torch is not 2.x"))
PY
    rm -rf "$tmp"
    return "$rc"
}

resolve() {
    say "resolving sglang==$version (no lock file $lock)"
    local pins
    pins=$(wheel_pins)
    say "pins from the wheel's metadata: $(echo "$pins" | tr '\n' ' ')"
    local torch_pin kernel_pin
    torch_pin=$(echo "$pins" | grep '^torch==')
    kernel_pin=$(echo "$pins" | grep '^sglang-kernel==')
    "$venv/bin/python" -m pip install "$torch_pin" "$(echo "$pins" | grep '^torchvision==')"
    "$venv/bin/python" -m pip install --no-deps "sglang==$version" "$kernel_pin"
    echo "$pins" > "$dir/constraints.txt"  # the wheel's own pins hold where they apply
    if [ -f "$here/constraints-$version.txt" ]; then
        grep -v '^#' "$here/constraints-$version.txt" >> "$dir/constraints.txt"
    fi
    # shellcheck disable=SC2046
    "$venv/bin/python" -m pip install -c "$dir/constraints.txt" "$torch_pin" \
        $(grep -v '^#' "$here/server-packages.txt")
    "$venv/bin/python" -m pip freeze --exclude-editable | grep -v '^pip==' > "$lock.new"
    mv "$lock.new" "$lock"
    say "wrote $lock"
}

build_stub() {
    mkdir -p "$dir/stub"
    gcc -shared -fPIC -O2 -Wall -Werror -o "$dir/stub/libcuda.so.1" "$stub_src"
    ln -sf libcuda.so.1 "$dir/stub/libcuda.so"
    # Every driver entry point sglang-kernel's libraries import must be in the stub.
    local need have missing
    need=$(find "$venv" -path '*sgl_kernel*' -name '*.so*' -exec nm -D --undefined-only {} + \
        | awk '{print $NF}' | sed 's/@.*//' | { grep -E '^cu[A-Z]' || true; } | sort -u)
    if [ -z "$need" ]; then
        say "found no sgl_kernel library importing CUDA driver symbols under $venv"
        exit 1
    fi
    have=$(nm -D --defined-only "$dir/stub/libcuda.so.1" | awk '{print $NF}' | sort -u)
    missing=$(comm -23 <(echo "$need") <(echo "$have"))
    if [ -n "$missing" ]; then
        say "the stub lacks driver symbols sglang-kernel imports (add them to $stub_src):"
        echo "$missing" >&2
        exit 1
    fi
    say "stub $dir/stub/libcuda.so.1 exports all $(echo "$need" | wc -l) driver symbols needed"
}

check() {
    LD_LIBRARY_PATH="$dir/stub${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" SGLANG_USE_CPU_ENGINE=1 \
        "$venv/bin/python" -c 'import sgl_kernel, sglang.launch_server, torch
print("sglang", __import__("sglang").__version__, "torch", torch.__version__,
      "cuda available:", torch.cuda.is_available())'
}

main() {
    if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ -f "$lock" ] \
        && [ "$(cat "$stamp")" = "$(want_stamp)" ]; then
        say "$dir is set up (sglang==$version, pins unchanged); install skipped"
    else
        mkdir -p "$dir"
        rm -f "$stamp"
        if [ ! -x "$venv/bin/python" ]; then
            say "creating $venv with $py"
            "$py" -m venv "$venv"
        fi
        "$venv/bin/python" -m pip install --quiet --upgrade "pip==25.3"
        if [ ! -f "$lock" ] || [ "${SGLANG_CPU_RESOLVE:-0}" = "1" ]; then
            resolve
        else
            "$venv/bin/python" -m pip install --no-deps -r "$lock"
        fi
        build_stub
        check
        want_stamp > "$stamp"
    fi
    echo "SGLang $version's CPU server is installed in $dir. Run the tier with:"
    if [ "$dir" = "$root/.sglang-cpu" ]; then
        echo "  .venv/bin/python -m pytest -m sglang_real tests/rollout"
    else
        echo "  MEGATRON_GSPO_SGLANG_CPU=$dir .venv/bin/python -m pytest -m sglang_real tests/rollout"
    fi
}

main

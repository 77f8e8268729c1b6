"""What the Python sandbox's first stage is given (computed once in the trainer): the files its
new root holds and the Landlock rules of the model's interpreter.

- `root_spec()`: the host paths bound read-only into the sandbox's fresh root (the standard
  library, the interpreter, ld.so and every shared library it or its extension modules load, the
  loader's cache), the device nodes bound beside them, the installed-package directories
  covered by an empty tmpfs and the `_ctypes` modules covered by /dev/null. Nothing else of the
  host exists there: `os.stat('/etc/passwd')` finds no file.
- `landlock_rules()`: the same paths as Landlock rules: standard-library trees (a directory that
  holds site-packages or `_ctypes` is split into its other entries), single files, directories
  whose names alone may be listed, the files that may be executed (the interpreter and ld.so:
  the first stage's one exec), and the device nodes that may be written.
- `stage_conf()`: both, with the run's temp dir, quota and uid, as the first stage's JSON.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import struct
import sys
import sysconfig

import megatron_gspo.agent.tools.sandbox_os as sandbox_os
import megatron_gspo.agent.tools.sandbox_seccomp as sandbox_seccomp

NOBODY = 65534
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
_HIDDEN = ("site-packages", "dist-packages")


def _interp(path: str) -> str | None:
    """PT_INTERP (the ELF loader) of a 64-bit little-endian executable, or None."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 16)
        if data[:6] != b"\x7fELF\x02\x01":
            return None
        phoff, = struct.unpack_from("<Q", data, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
        for i in range(phnum):
            p_type, _, p_offset, _, _, p_filesz = struct.unpack_from(
                "<IIQQQQ", data, phoff + i * phentsize)
            if p_type == 3:  # PT_INTERP
                return data[p_offset:p_offset + p_filesz].rstrip(b"\0").decode()
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None


def python_exe() -> str:
    """The interpreter the model's code runs in (real path, no venv link)."""
    return os.path.realpath(sys.executable)


@functools.lru_cache(maxsize=1)
def stdlib_roots() -> tuple[str, ...]:
    """The directories (and zip) on the sys.path of `python -I -S`: the standard library."""
    # the base interpreter's paths (a venv's platstdlib would name the venv)
    paths = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix,
                                      "installed_base": sys.base_prefix,
                                      "installed_platbase": sys.base_exec_prefix})
    zipped = os.path.join(sysconfig.get_config_var("LIBDIR") or "",
                          f"python{sys.version_info[0]}{sys.version_info[1]}.zip")
    cands = [paths["stdlib"], paths["platstdlib"],
             os.path.join(paths["platstdlib"], "lib-dynload"), zipped]
    out: list[str] = []
    for p in (os.path.realpath(c) for c in cands):
        if os.path.exists(p) and p not in out:
            out.append(p)
    return tuple(out)


@functools.lru_cache(maxsize=1)
def masked_files() -> tuple[str, ...]:
    """The `_ctypes` extension modules: the model's interpreter can neither read nor import
    them (only the first stage, gone before the model's code runs, uses ctypes)."""
    out = []
    for root in stdlib_roots():
        if os.path.isdir(root):
            out += glob.glob(os.path.join(root, "**", "_ctypes*.so"), recursive=True)
    return tuple(sorted({os.path.realpath(p) for p in out}))


@functools.lru_cache(maxsize=1)
def root_spec() -> dict:
    """Paths of the sandbox's root: `binds` (read-only), `devices`, `hidden` (empty tmpfs over
    them) and `masked` (/dev/null over them)."""
    exe = python_exe()
    binds = [r for r in stdlib_roots()
             if not any(r.startswith(o + os.sep) for o in stdlib_roots() if o != r)]
    loader = _interp(exe)
    for p in (exe, *([loader] if loader else []), *sandbox_os.readable_files()):
        if p not in binds:
            binds.append(p)
    return {"binds": binds, "devices": [d for d in DEVICES if os.path.exists(d)],
            "hidden": list(sandbox_os.hidden_dirs()), "masked": list(masked_files())}


def _split(path: str, excluded: frozenset[str], trees: list, files: list, listed: list) -> None:
    inner = [e for e in excluded if e.startswith(path + os.sep)]
    if not inner:
        trees.append(path)
        return
    listed.append(path)
    for name in sorted(os.listdir(path)):
        q = os.path.join(path, name)
        if q in excluded:
            continue
        if os.path.isdir(q) and not os.path.islink(q):
            _split(q, excluded, trees, files, listed)
        else:
            files.append(os.path.realpath(q))


@functools.lru_cache(maxsize=1)
def landlock_rules() -> dict:
    """Landlock rules of the model's interpreter: `trees` (read), `files` (read), `listed`
    (names only), `exec` (read and execute), `devices` (read and write)."""
    excluded = frozenset(
        [os.path.realpath(os.path.join(r, h)) for r in stdlib_roots() for h in _HIDDEN]
        + list(masked_files()))
    trees: list[str] = []
    files: list[str] = []
    listed: list[str] = []
    for root in stdlib_roots():
        if any(root == t or root.startswith(t + os.sep) for t in trees + listed):
            continue  # inside a root already covered
        if os.path.isdir(root):
            _split(root, excluded, trees, files, listed)
        else:
            files.append(root)
    exe = python_exe()
    loader = _interp(exe)
    execs = [exe] + ([os.path.realpath(loader)] if loader else [])
    files += [f for f in sandbox_os.readable_files() if f not in files]
    return {"trees": trees, "files": files, "listed": listed, "exec": execs,
            "devices": [d for d in DEVICES if os.path.exists(d)]}


def stage_conf(tmp: str, quota: int, *, landlock: bool, new_root: bool) -> str:
    """The first stage's configuration (JSON, one argument).

    Args:
        tmp: the run's temp dir (its work dir, same path inside the new root).
        quota: bytes of the work dir's tmpfs (new root only).
        landlock: whether to confine with Landlock.
        new_root: build the new root, pivot into it and drop to uid `NOBODY` (only as real
            root in a fresh mount and PID namespace).
    Returns:
        the JSON text.
    """
    arch = sandbox_seccomp.arch_name() or "x86_64"
    col = 0 if arch == "x86_64" else 1
    calls = sandbox_seccomp._CALLS
    return json.dumps({
        "tmp": tmp, "quota": int(quota), "uid": NOBODY, "landlock": bool(landlock),
        "new_root": bool(new_root), "root": root_spec() if new_root else None,
        "rules": landlock_rules() if landlock else None, "key_slots": sandbox_seccomp.KEY_SLOTS,
        "nr": {"execve": calls["execve"][col], "pivot_root": calls["pivot_root"][col]},
    })

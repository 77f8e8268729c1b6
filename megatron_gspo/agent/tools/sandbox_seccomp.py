"""The seccomp-BPF filter of the Python sandbox: system calls the kernel refuses to the child
whatever the Python layer does (the audit hook is a convenience layer, this is a wall).

`filter_program()` builds the classic-BPF program (struct sock_filter[]) in the trainer; the
child's bootstrap installs it with prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER) right before the
user's program runs (after Landlock, which set PR_SET_NO_NEW_PRIVS). The filter:
- kills the process on a foreign architecture (e.g. int 0x80 i386 calls from an x86_64
  process) and refuses the x32 range on x86_64 (syscall numbers with bit 30 set);
- refuses, with EPERM: every socket (`socket`, `socketpair`: no unix socket of the host, bound
  to a path or abstract, is reachable; Landlock does not cover pathname unix sockets), `io_uring`
  (it creates and connects sockets without those calls), every exec (`execve`, `execveat`;
  Landlock already refuses exec of files, but not of a memfd) and `memfd_create`/`memfd_secret`,
  another process's memory or fds (`ptrace`, `process_vm_readv/writev`, `pidfd_getfd`, `kcmp`),
  namespaces and mounts (`unshare`, `setns`, `clone` with a CLONE_NEW* flag, `mount` and the new
  mount API, `pivot_root`, `chroot`), file handles (`open_by_handle_at`), kernel keyrings, BPF,
  perf events, userfaultfd, modules, kexec, swap, reboot, accounting, quotas, and the
  terminal-injection ioctls TIOCSTI / TIOCLINUX;
- answers `clone3` with ENOSYS (its flags sit in memory the filter cannot read; the C library
  then falls back to `clone`, whose flags it can);
- lets exactly one `execve` through: the one whose unused fourth argument register holds a
  64-bit key. The program carries two placeholder words (`KEY_SLOTS`); the sandbox's first stage
  writes a fresh random key over them (`with_exec_key`), installs the filter and execs the
  final interpreter with that key through syscall(2). The key exists nowhere in the new process
  (the kernel keeps the filter), and Python cannot choose a register's value, so every later
  exec is refused: the model's interpreter never loaded ctypes, and cannot exec anything.
Numbers are those of x86_64 and aarch64 (asm/unistd_64.h, asm-generic/unistd.h).
"""

from __future__ import annotations

import errno
import platform
import struct

__all__ = ["DENIED", "KEY_SLOTS", "arch_name", "filter_program", "with_exec_key"]

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
_NR, _ARCH, _ARG0, _ARG1, _ARG3 = 0, 4, 16, 24, 40
# placeholder words of the exec key (low, high half of argument 3); replaced per run
KEY_SLOTS = (0x9E3779B9, 0x7F4A7C15)
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_CLONE_NEW = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
_BAD_IOCTLS = (0x5412, 0x541C)  # TIOCSTI, TIOCLINUX

# name: (x86_64, aarch64); None where the architecture has no such call
_CALLS: dict[str, tuple[int | None, int | None]] = {
    "socket": (41, 198), "socketpair": (53, 199),
    "execve": (59, 221), "execveat": (322, 281),
    "memfd_create": (319, 279), "memfd_secret": (447, 447),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "pidfd_getfd": (438, 438), "kcmp": (312, 272),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "unshare": (272, 97), "setns": (308, 268),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430),
    "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294),
    "swapon": (167, 224), "swapoff": (168, 225), "reboot": (169, 142), "acct": (163, 89),
    "quotactl": (179, 60), "iopl": (172, None), "ioperm": (173, None),
}
DENIED = tuple(sorted(_CALLS))
_CLONE, _CLONE3, _IOCTL = (56, 220), (435, 435), (16, 29)
# AUDIT_ARCH_X86_64 = EM_X86_64 | 64BIT | LE; AUDIT_ARCH_AARCH64 = EM_AARCH64 | 64BIT | LE
_ARCHES = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}
_MACHINES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def arch_name(machine: str | None = None) -> str | None:
    """'x86_64' or 'aarch64' for this (or the named) machine; None where no filter is known."""
    return _MACHINES.get((machine or platform.machine()).lower())


def filter_program(arch: str | None = None) -> bytes:
    """The filter as packed `struct sock_filter` entries (8 bytes each, native order).

    Args:
        arch: 'x86_64' or 'aarch64' (default: this machine's).
    Returns:
        the program, ready for a `struct sock_fprog`.
    Raises:
        ValueError: no filter for this architecture.
    """
    arch = arch or arch_name()
    if arch not in _ARCHES:
        raise ValueError(f"no seccomp filter for the {platform.machine()!r} architecture "
                         "(x86_64 and aarch64 only)")
    col, audit_arch = _ARCHES[arch]
    prog: list[tuple] = []  # (code, jt label or offset, jf label or offset, k)

    def op(code, k, jt=0, jf=0):
        prog.append((code, jt, jf, k))

    op(_LD_W_ABS, _ARCH)
    op(_JEQ_K, audit_arch, 0, "kill")
    op(_LD_W_ABS, _NR)
    if arch == "x86_64":
        op(_JGE_K, 0x40000000, "eperm", 0)  # the x32 ABI
    for name in DENIED:
        nr = _CALLS[name][col]
        if nr is not None and name != "execve":
            op(_JEQ_K, nr, "eperm", 0)
    op(_JEQ_K, _CALLS["execve"][col], "exec", 0)
    op(_JEQ_K, _CLONE3[col], "enosys", 0)
    op(_JEQ_K, _CLONE[col], "clone", 0)
    op(_JEQ_K, _IOCTL[col], "ioctl", 0)
    op(_RET_K, _RET_ALLOW)
    labels = {"exec": len(prog)}
    op(_LD_W_ABS, _ARG3)  # the key, low half then high half
    op(_JEQ_K, KEY_SLOTS[0], 0, "eperm")
    op(_LD_W_ABS, _ARG3 + 4)
    op(_JEQ_K, KEY_SLOTS[1], 0, "eperm")
    op(_RET_K, _RET_ALLOW)
    labels["clone"] = len(prog)
    op(_LD_W_ABS, _ARG0)  # low 32 bits of the flags (little-endian)
    op(_JSET_K, _CLONE_NEW, "eperm", 0)
    op(_RET_K, _RET_ALLOW)
    labels["ioctl"] = len(prog)
    op(_LD_W_ABS, _ARG1)  # low 32 bits of the request
    for req in _BAD_IOCTLS:
        op(_JEQ_K, req, "eperm", 0)
    op(_RET_K, _RET_ALLOW)
    for name, value in (("eperm", _RET_ERRNO | errno.EPERM),
                        ("enosys", _RET_ERRNO | errno.ENOSYS), ("kill", _RET_KILL_PROCESS)):
        labels[name] = len(prog)
        op(_RET_K, value)
    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(prog):
        jt, jf = (labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf))
        if not (0 <= jt <= 255 and 0 <= jf <= 255):
            raise AssertionError("seccomp filter: a jump does not fit in 8 bits")
        out += struct.pack("=HBBI", code, jt, jf, k)
    return bytes(out)


def with_exec_key(prog: bytes, key: int) -> bytes:
    """`prog` with the 64-bit `key` written over its placeholder words (the same replacement the
    sandbox's first stage makes; kept here for tests).

    Args:
        prog: a program from `filter_program`.
        key: the exec key, both 32-bit halves non-zero.
    Returns:
        the program that allows execve only with `key` as its fourth argument.
    """
    out = bytearray(prog)
    for slot, word in zip(KEY_SLOTS, (key & 0xFFFFFFFF, key >> 32), strict=True):
        offs = [i for i in range(4, len(out), 8) if out[i:i + 4] == struct.pack("=I", slot)]
        if len(offs) != 1 or not word:
            raise ValueError("seccomp filter: the exec key slot is missing or the key is 0")
        out[offs[0]:offs[0] + 4] = struct.pack("=I", word)
    return bytes(out)

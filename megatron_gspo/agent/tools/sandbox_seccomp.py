"""The seccomp-BPF filter of the Python sandbox: system calls the kernel refuses to the child
whatever the Python layer does (the audit hook is a convenience layer, this is a wall).

`filter_program()` builds the classic-BPF program (struct sock_filter[]) in the trainer; the
child's bootstrap installs it with prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER) right before the
user's program runs (after Landlock, which set PR_SET_NO_NEW_PRIVS). The filter is default-deny
(issue 54, defect 11): only the reviewed calls of `sandbox_syscalls.ALLOWED` pass; every other
number, a call a later kernel adds included, is answered ENOSYS as by a kernel without it. It:
- kills the process on a foreign architecture (e.g. int 0x80 i386 calls from an x86_64
  process) and refuses the x32 range on x86_64 (syscall numbers with bit 30 set);
- refuses, with EPERM (`sandbox_syscalls.DENIED_CALLS`): every socket (`socket`, `socketpair`:
  no unix socket of the host, bound to a path or abstract, is reachable; Landlock does not
  cover pathname unix sockets), `io_uring` (it creates and connects sockets without those
  calls), every exec (`execve`, `execveat`; Landlock already refuses exec of files, but not of
  a memfd) and `memfd_create`/`memfd_secret`, another process's memory or fds (`ptrace`,
  `process_vm_readv/writev`, `pidfd_getfd`, `kcmp`), namespaces and mounts (`unshare`,
  `setns`, `clone` with a CLONE_NEW* flag, `mount` and the new mount API with
  `open_tree_attr`, `listmount`, `statmount`, `pivot_root`, `chroot`), file handles
  (`open_by_handle_at`), fanotify, `syslog`, setting the clock, kernel keyrings, BPF, perf
  events, userfaultfd, modules, kexec, swap, reboot, accounting, quotas, and the
  terminal-injection ioctls TIOCSTI / TIOCLINUX; with `processes=False` also every new
  process (the call's fallback bound where no cgroup can be made);
- answers `clone3` with ENOSYS (its flags sit in memory the filter cannot read; the C library
  then falls back to `clone`, whose flags it can);
- lets exactly one `execve` through: the one whose unused fourth argument register holds a
  64-bit key. The program carries two placeholder words (`KEY_SLOTS`); the sandbox's first stage
  writes a fresh random key over them (`with_exec_key`), installs the filter and execs the
  final interpreter with that key through syscall(2). The key exists nowhere in the new process
  (the kernel keeps the filter), and Python cannot choose a register's value, so every later
  exec is refused: the model's interpreter never loaded ctypes, and cannot exec anything.
Numbers are those of x86_64 and aarch64 (`sandbox_syscalls`).
"""

from __future__ import annotations

import errno
import platform
import struct

from megatron_gspo.agent.tools.sandbox_syscalls import ALLOWED, DENIED_CALLS

__all__ = ["DENIED", "KEY_SLOTS", "arch_name", "filter_program", "with_exec_key"]

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
_NR, _ARCH, _ARG0, _ARG1, _ARG3 = 0, 4, 16, 24, 40
# placeholder words of the exec key (low, high half of argument 3); replaced per run
KEY_SLOTS = (0x9E3779B9, 0x7F4A7C15)
_LD_W_ABS, _JA, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x05, 0x15, 0x35, 0x45, 0x06
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_CLONE_NEW = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
_BAD_IOCTLS = (0x5412, 0x541C)  # TIOCSTI, TIOCLINUX

_CALLS = DENIED_CALLS
DENIED = tuple(sorted(_CALLS))
_CLONE, _CLONE3, _IOCTL = (56, 220), (435, 435), (16, 29)
_FORKS = ((57, None), (58, None))  # fork, vfork (x86_64 only)
_CLONE_THREAD = 0x10000
# AUDIT_ARCH_X86_64 = EM_X86_64 | 64BIT | LE; AUDIT_ARCH_AARCH64 = EM_AARCH64 | 64BIT | LE
_ARCHES = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}
_MACHINES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def arch_name(machine: str | None = None) -> str | None:
    """'x86_64' or 'aarch64' for this (or the named) machine; None where no filter is known."""
    return _MACHINES.get((machine or platform.machine()).lower())


def filter_program(arch: str | None = None, *, processes: bool = True) -> bytes:
    """The filter as packed `struct sock_filter` entries (8 bytes each, native order).

    Args:
        arch: 'x86_64' or 'aarch64' (default: this machine's).
        processes: False refuses every new process (fork, vfork, a clone without
            CLONE_THREAD; threads still start): the call is one process, so its rlimits bound
            it as a whole (the fallback where no cgroup can be made).
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
    prog: list[tuple] = []  # (code, jt, jf, k); every jump is forward and short
    eperm, enosys, allow = _RET_ERRNO | errno.EPERM, _RET_ERRNO | errno.ENOSYS, _RET_ALLOW

    def op(code, k, jt=0, jf=0):
        prog.append((code, jt, jf, k))

    def when(nr, *block):  # if the number is nr: the block (which returns)
        op(_JEQ_K, nr, 0, len(block))
        prog.extend(block)

    def ret(value):
        return (_RET_K, 0, 0, value)

    def ld(offset):
        return (_LD_W_ABS, 0, 0, offset)

    op(_LD_W_ABS, _ARCH)
    op(_JEQ_K, audit_arch, 0, 1)
    op(_JA, 1)  # over the kill
    op(_RET_K, _RET_KILL_PROCESS)
    op(_LD_W_ABS, _NR)
    if arch == "x86_64":
        op(_JGE_K, 0x40000000, 0, 1)  # the x32 ABI
        op(_RET_K, eperm)
    # execve: only with the key in argument 3 (low half, then high half)
    when(DENIED_CALLS["execve"][col], ld(_ARG3), (_JEQ_K, 0, 3, KEY_SLOTS[0]), ld(_ARG3 + 4),
         (_JEQ_K, 0, 1, KEY_SLOTS[1]), ret(allow), ret(eperm))
    when(_CLONE3[col], ret(enosys))  # its flags sit in memory; the C library falls back to clone
    single = () if processes else ((_JSET_K, 1, 0, _CLONE_THREAD), ret(eperm))
    when(_CLONE[col], ld(_ARG0), (_JSET_K, 0, 1, _CLONE_NEW), ret(eperm), *single, ret(allow))
    bad_ioctls = [x for req in _BAD_IOCTLS for x in ((_JEQ_K, 0, 1, req), ret(eperm))]
    when(_IOCTL[col], ld(_ARG1), *bad_ioctls, ret(allow))
    for nr in (f[col] for f in _FORKS):
        if nr is not None and not processes:
            when(nr, ret(eperm))
    for name in DENIED:
        nr = DENIED_CALLS[name][col]
        if nr is not None and name != "execve":
            when(nr, ret(eperm))
    for nrs in ALLOWED.values():
        if nrs[col] is not None and nrs[col] not in (_CLONE[col], _IOCTL[col]):
            when(nrs[col], ret(allow))
    op(_RET_K, enosys)  # not reviewed: as by a kernel without the call
    out = bytearray()
    for code, jt, jf, k in prog:
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

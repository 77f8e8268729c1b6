"""System-call tables of the Python sandbox's seccomp filter (`sandbox_seccomp`), x86_64 and
aarch64 numbers (asm/unistd_64.h, asm-generic/unistd.h; calls after Linux 6.6 from the kernel's
syscall tables).

The filter is default-deny (issue 54, defect 11: a deny-list missed `open_tree_attr`,
`listmount`/`statmount`, `fanotify_init`, `syslog`, `settimeofday`): only the calls in
`ALLOWED` pass (reviewed: what CPython and its standard library use on a process's own memory,
files, fds, signals, time and scheduling); `DENIED` are refused with EPERM (the reasons are
named in `sandbox_seccomp`); every other number, including calls a later kernel adds, is
answered ENOSYS, as by a kernel that lacks the call. Not allowed, among others: sockets, SysV
and POSIX message IPC (the sandbox shares the host's IPC namespace), legacy AIO, fanotify,
setting the clock, the host name or ids, personality, the LDT, Landlock and LSM
attributes, mount and namespace calls, module loading.
"""

from __future__ import annotations

__all__ = ["ALLOWED", "DENIED_CALLS"]

# name: (x86_64, aarch64); None where the architecture has no such call. Hot calls first (the
# filter tests them in this order).
ALLOWED: dict[str, tuple[int | None, int | None]] = {
    "read": (0, 63), "write": (1, 64), "openat": (257, 56), "close": (3, 57),
    "newfstatat": (262, 79), "fstat": (5, 80), "lseek": (8, 62), "mmap": (9, 222),
    "munmap": (11, 215), "mprotect": (10, 226), "brk": (12, 214), "futex": (202, 98),
    "getdents64": (217, 61), "ioctl": (16, 29), "rt_sigaction": (13, 134),
    "rt_sigprocmask": (14, 135), "pread64": (17, 67), "pwrite64": (18, 68), "readv": (19, 65),
    "writev": (20, 66), "getpid": (39, 172), "gettid": (186, 178), "clock_gettime": (228, 113),
    "madvise": (28, 233), "mremap": (25, 216), "statx": (332, 291), "stat": (4, None),
    "lstat": (6, None), "fcntl": (72, 25), "dup": (32, 23), "dup3": (292, 24), "pipe2": (293, 59),
    "readlinkat": (267, 78), "readlink": (89, None), "access": (21, None), "faccessat": (269, 48),
    "faccessat2": (439, 439), "getcwd": (79, 17), "getrandom": (318, 278),
    "sched_yield": (24, 124), "exit": (60, 93), "exit_group": (231, 94), "wait4": (61, 260),
    "waitid": (247, 95), "clone": (56, 220), "fork": (57, None), "vfork": (58, None),
    "poll": (7, None), "ppoll": (271, 73), "select": (23, None), "pselect6": (270, 72),
    "epoll_create1": (291, 20), "epoll_ctl": (233, 21), "epoll_wait": (232, None),
    "epoll_pwait": (281, 22), "epoll_pwait2": (441, 441), "open": (2, None), "creat": (85, None),
    "close_range": (436, 436), "openat2": (437, 437), "fstatfs": (138, 44), "statfs": (137, 43),
    "getdents": (78, None), "dup2": (33, None), "pipe": (22, None), "mkdir": (83, None),
    "mkdirat": (258, 34), "rmdir": (84, None), "unlink": (87, None), "unlinkat": (263, 35),
    "rename": (82, None), "renameat": (264, 38), "renameat2": (316, 276), "link": (86, None),
    "linkat": (265, 37), "symlink": (88, None), "symlinkat": (266, 36), "chmod": (90, None),
    "fchmod": (91, 52), "fchmodat": (268, 53), "fchmodat2": (452, 452), "chown": (92, None),
    "fchown": (93, 55), "lchown": (94, None), "fchownat": (260, 54), "umask": (95, 166),
    "truncate": (76, 45), "ftruncate": (77, 46), "fallocate": (285, 47), "mknod": (133, None),
    "mknodat": (259, 33), "fsync": (74, 82), "fdatasync": (75, 83), "sync": (162, 81),
    "syncfs": (306, 267), "sync_file_range": (277, 84), "flock": (73, 32), "utime": (132, None),
    "utimes": (235, None), "utimensat": (280, 88), "futimesat": (261, None), "chdir": (80, 49),
    "fchdir": (81, 50), "sendfile": (40, 71), "copy_file_range": (326, 285), "splice": (275, 76),
    "tee": (276, 77), "vmsplice": (278, 75), "readahead": (187, 213), "fadvise64": (221, 223),
    "preadv": (295, 69), "pwritev": (296, 70), "preadv2": (327, 286), "pwritev2": (328, 287),
    "getxattr": (191, 8), "lgetxattr": (192, 9), "fgetxattr": (193, 10), "listxattr": (194, 11),
    "llistxattr": (195, 12), "flistxattr": (196, 13), "setxattr": (188, 5), "lsetxattr": (189, 6),
    "fsetxattr": (190, 7), "removexattr": (197, 14), "lremovexattr": (198, 15),
    "fremovexattr": (199, 16), "getxattrat": (464, 464), "listxattrat": (465, 465),
    "setxattrat": (463, 463), "removexattrat": (466, 466), "inotify_init": (253, None),
    "inotify_init1": (294, 26), "inotify_add_watch": (254, 27), "inotify_rm_watch": (255, 28),
    "msync": (26, 227), "mincore": (27, 232), "mlock": (149, 228), "mlock2": (325, 284),
    "munlock": (150, 229), "mlockall": (151, 230), "munlockall": (152, 231),
    "remap_file_pages": (216, 234), "pkey_mprotect": (329, 288), "pkey_alloc": (330, 289),
    "pkey_free": (331, 290), "mbind": (237, 235), "set_mempolicy": (238, 237),
    "get_mempolicy": (239, 236), "set_mempolicy_home_node": (450, 450), "membarrier": (324, 283),
    "rseq": (334, 293), "mseal": (462, 462), "map_shadow_stack": (453, 453),
    "cachestat": (451, 451), "rt_sigreturn": (15, 139), "rt_sigpending": (127, 136),
    "rt_sigtimedwait": (128, 137), "rt_sigqueueinfo": (129, 138), "rt_tgsigqueueinfo": (297, 240),
    "rt_sigsuspend": (130, 133), "sigaltstack": (131, 132), "kill": (62, 129), "tkill": (200, 130),
    "tgkill": (234, 131), "pidfd_open": (434, 434), "pidfd_send_signal": (424, 424),
    "pause": (34, None), "alarm": (37, None), "nanosleep": (35, 101),
    "clock_nanosleep": (230, 115), "getitimer": (36, 102), "setitimer": (38, 103),
    "timer_create": (222, 107), "timer_settime": (223, 110), "timer_gettime": (224, 108),
    "timer_getoverrun": (225, 109), "timer_delete": (226, 111), "timerfd_create": (283, 85),
    "timerfd_settime": (286, 86), "timerfd_gettime": (287, 87), "eventfd": (284, None),
    "eventfd2": (290, 19), "signalfd": (282, None), "signalfd4": (289, 74),
    "epoll_create": (213, None), "clock_getres": (229, 114), "gettimeofday": (96, 169),
    "time": (201, None), "times": (100, 153), "getrusage": (98, 165), "sysinfo": (99, 179),
    "uname": (63, 160), "getcpu": (309, 168), "getrlimit": (97, 163), "setrlimit": (160, 164),
    "prlimit64": (302, 261), "getpriority": (140, 141), "setpriority": (141, 140),
    "sched_setparam": (142, 118), "sched_getparam": (143, 121), "sched_setscheduler": (144, 119),
    "sched_getscheduler": (145, 120), "sched_get_priority_max": (146, 125),
    "sched_get_priority_min": (147, 126), "sched_rr_get_interval": (148, 127),
    "sched_setaffinity": (203, 122), "sched_getaffinity": (204, 123), "sched_setattr": (314, 274),
    "sched_getattr": (315, 275), "ioprio_get": (252, 31), "getuid": (102, 174),
    "geteuid": (107, 175), "getgid": (104, 176), "getegid": (108, 177), "getresuid": (118, 148),
    "getresgid": (120, 150), "getgroups": (115, 158), "getppid": (110, 173),
    "getpgrp": (111, None), "getpgid": (121, 155), "getsid": (124, 156), "setpgid": (109, 154),
    "setsid": (112, 157), "capget": (125, 90), "prctl": (157, 167), "arch_prctl": (158, None),
    "set_tid_address": (218, 96), "set_robust_list": (273, 99), "get_robust_list": (274, 100),
    "futex_waitv": (449, 449), "futex_wake": (454, 454), "futex_wait": (455, 455),
    "futex_requeue": (456, 456), "restart_syscall": (219, 128),
}

# refused with EPERM (name: (x86_64, aarch64))
DENIED_CALLS: dict[str, tuple[int | None, int | None]] = {
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
    "mount_setattr": (442, 442), "open_tree_attr": (467, 467),
    "statmount": (457, 457), "listmount": (458, 458),
    "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
    "fanotify_init": (300, 262), "fanotify_mark": (301, 263),
    "syslog": (103, 116), "settimeofday": (164, 170), "clock_settime": (227, 112),
    "clock_adjtime": (305, 266), "adjtimex": (159, 171),
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294),
    "swapon": (167, 224), "swapoff": (168, 225), "reboot": (169, 142), "acct": (163, 89),
    "quotactl": (179, 60), "iopl": (172, None), "ioperm": (173, None),
}

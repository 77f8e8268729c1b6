"""The Python sandbox's first stage: the privileged setup, in a process the model's code never
runs in.

`STAGE` runs as `python -I -S -c STAGE <conf json> <seccomp hex> -- <final argv>` (conf from
`sandbox_mounts.stage_conf`). With `new_root` (the trainer is real root; the stage runs in fresh
mount, PID and network namespaces):
1. builds a new root on the temp dir: a small tmpfs holding read-only bind mounts of exactly
   the standard library, the interpreter, ld.so and the shared libraries it loads (symbolic
   links on their paths recreated), device nodes (/dev/null, /dev/zero, /dev/urandom,
   /dev/random), installed-package directories under an empty tmpfs, `_ctypes` covered by
   /dev/null, and the work dir: a tmpfs of the quota's size owned by uid 65534, at the temp
   dir's own path; the new root itself is then remounted read-only;
2. pivot_root into it and detaches the old root: no other host path exists any more, so
   `os.stat`/`os.access` learn nothing of the host's tree;
3. drops to uid/gid 65534 (nobody) with no supplementary groups and no capabilities, then
   enters a user namespace of its own (process counts, RLIMIT_NPROC, are per run);
Then, in every mode: Landlock (reads of the listed files only, writes inside the work dir,
execute of the interpreter and ld.so only), PR_SET_NO_NEW_PRIVS, the seccomp filter with a
fresh random exec key written into it, and one execve of the final interpreter carrying that
key. The final interpreter (`sandbox_boot.BOOTSTRAP`) never imports ctypes, and can exec
nothing itself.
"""

STAGE = r"""
def _stage():
    import sys, os, json, struct, ctypes
    conf, prog, final = json.loads(sys.argv[1]), bytes.fromhex(sys.argv[2]), sys.argv[4:]
    libc = ctypes.CDLL(None, use_errno=True)
    sc = libc.syscall
    sc.restype = ctypes.c_long
    try:
        if conf["new_root"]:
            _new_root(libc, sc, conf)
            _drop(libc, conf["uid"])
        if conf["landlock"]:
            _landlock(libc, sc, conf["tmp"], conf["rules"])
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
        key = 0
        while not (key & 0xFFFFFFFF and key >> 32):
            key = int.from_bytes(os.urandom(8), "little")
        prog = bytearray(prog)
        for slot, word in zip(conf["key_slots"], (key & 0xFFFFFFFF, key >> 32)):
            offs = [i for i in range(4, len(prog), 8) if prog[i:i + 4] == struct.pack("=I", slot)]
            if len(offs) != 1:
                raise OSError(0, "seccomp: the filter has no exec key slot")
            prog[offs[0]:offs[0] + 4] = struct.pack("=I", word)

        class FProg(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

        fprog = FProg(len(prog) // 8, bytes(prog))
        if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, MODE_FILTER
            raise OSError(ctypes.get_errno(), "seccomp")
        args = [a.encode("utf-8", "surrogateescape") for a in final]
        env = [k.encode() + b"=" + v.encode("utf-8", "surrogateescape")
               for k, v in os.environ.items()]
        argv = (ctypes.c_char_p * (len(args) + 1))(*args, None)
        envp = (ctypes.c_char_p * (len(env) + 1))(*env, None)
        sc(conf["nr"]["execve"], args[0], argv, envp, ctypes.c_uint64(key))
        raise OSError(ctypes.get_errno(), "execve " + final[0])
    except OSError as e:
        if e.filename is not None:
            what = str(e)
        else:
            what = str(e.strerror) + (": " + os.strerror(e.errno) if e.errno else "")
        sys.stderr.write("sandbox: cannot confine the program: " + what + "\n")
        sys.stderr.flush()
        os._exit(125)


def _new_root(libc, sc, conf):
    import os, ctypes
    RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND = 1, 2, 4, 8, 32, 4096
    root, tmp, spec = conf["tmp"], conf["tmp"], conf["root"]

    def mount(src, dst, fstype, flags, data=None):
        enc = lambda s: None if s is None else s.encode()
        if libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
            raise OSError(ctypes.get_errno(), "mount " + dst)

    mount("sandbox-root", root, "tmpfs", NOSUID | NODEV, "size=1m,nr_inodes=4096,mode=0755")
    done, dirs = set(), []

    def bind(src, flags):
        dst = root + src
        if os.path.isdir(src):
            os.makedirs(dst, exist_ok=True)
            dirs.append(src)
        else:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if not os.path.exists(dst):
                open(dst, "x").close()
        mount(src, dst, None, BIND)
        mount(None, dst, None, REMOUNT | BIND | flags)

    def place(path, whole=True):
        # the real file or dir (a directory a link points to: only its place, unless `whole`),
        # and every symbolic link on the way to it, at their host paths
        cur = ""
        for part in path.strip("/").split("/"):
            cur += "/" + part
            if os.path.islink(cur):
                loc = os.path.join(os.path.realpath(os.path.dirname(cur)), part)
                if loc not in done:
                    done.add(loc)
                    target = os.readlink(cur)
                    os.makedirs(root + os.path.dirname(loc), exist_ok=True)
                    os.symlink(target, root + loc)
                    place(os.path.normpath(os.path.join(os.path.dirname(loc), target)), False)
        real = os.path.realpath(path)
        if not whole and os.path.isdir(real):
            if not any(real == d or real.startswith(d + "/") for d in dirs):
                os.makedirs(root + real, exist_ok=True)
            return
        if real in done or any(real.startswith(d + "/") for d in dirs) or not os.path.exists(real):
            return
        done.add(real)
        bind(real, RDONLY | NOSUID | NODEV)

    for p in spec["binds"]:
        place(p)
    for d in spec["devices"]:
        bind(d, RDONLY | NOSUID)
    for h in spec["hidden"]:
        if os.path.isdir(root + h):
            mount("hidden", root + h, "tmpfs", RDONLY | NOSUID | NODEV | NOEXEC,
                  "size=4k,nr_inodes=1,mode=0555")
    for m in spec["masked"]:
        if os.path.exists(root + m):
            mount("/dev/null", root + m, None, BIND)
            mount(None, root + m, None, REMOUNT | BIND | RDONLY | NOSUID | NODEV | NOEXEC)
    os.makedirs(root + tmp)
    u = conf["uid"]
    mount("sandbox", root + tmp, "tmpfs", NOSUID | NODEV | NOEXEC,
          "size=%d,nr_inodes=4096,mode=0700,uid=%d,gid=%d" % (conf["quota"], u, u))
    mount(None, root, None, REMOUNT | RDONLY | NOSUID | NODEV)
    os.chdir(root)
    if sc(conf["nr"]["pivot_root"], b".", b".") != 0:
        raise OSError(ctypes.get_errno(), "pivot_root")
    if libc.umount2(b".", 2) != 0:  # MNT_DETACH: the old root is gone from this namespace
        raise OSError(ctypes.get_errno(), "umount of the old root")
    os.chdir("/")
    os.chdir(tmp)


def _drop(libc, uid):
    import os, ctypes
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # no capabilities left
    if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER: RLIMIT_NPROC counts this run only
        raise OSError(ctypes.get_errno(), "unshare of the user namespace")


def _landlock(libc, sc, tmp, rules):
    import os, ctypes, struct
    abi = sc(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, LANDLOCK_..._VERSION)
    if abi < 1:
        raise OSError(ctypes.get_errno(), "Landlock (none in this kernel)")
    fs = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (
        1 << 15 if abi >= 5 else 0)
    attr = struct.pack("=Q", fs)
    if abi >= 4:
        attr += struct.pack("=Q", 3)  # TCP bind and connect: no rule allows any
    if abi >= 6:
        attr += struct.pack("=Q", 3)  # scoped: abstract unix sockets and signals
    buf = ctypes.create_string_buffer(attr, len(attr))
    rs = sc(444, buf, len(attr), 0)
    if rs < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    execute, write, read_file, read_dir, truncate = 1, 1 << 1, 1 << 2, 1 << 3, 1 << 14
    # work dir: read, write, make and remove files and directories (no exec, devices,
    # sockets, fifos or symlinks); refer (renames between its directories), truncate
    rw = fs & (write | read_file | read_dir | (1 << 4) | (1 << 5) | (1 << 7) | (1 << 8)
               | (1 << 13) | truncate)
    allowed = [(tmp, rw)] + [(p, read_file | read_dir) for p in rules["trees"]] + [
        (p, read_file) for p in rules["files"]] + [(p, read_dir) for p in rules["listed"]] + [
        (p, execute | read_file) for p in rules["exec"]] + [
        (p, fs & (read_file | write | truncate)) for p in rules["devices"]]
    for path, access in allowed:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        rule = ctypes.create_string_buffer(struct.pack("=Qi", access, fd), 12)
        r = sc(445, ctypes.c_long(rs), 1, rule, 0)  # LANDLOCK_RULE_PATH_BENEATH
        e = ctypes.get_errno()
        os.close(fd)
        if r < 0 and path == tmp:
            raise OSError(e, "landlock_add_rule")
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if sc(446, ctypes.c_long(rs), 0) < 0:  # landlock_restrict_self
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    os.close(rs)

_stage()
"""

# Init of the PID namespace when the first stage builds a new root: it leaves the host's tree
# (its cwd moves into the new root with pivot_root), runs the stage and passes on its status.
INIT_NEW_ROOT = r"""
cd / || exit 1
"$@"; exit $?
"""

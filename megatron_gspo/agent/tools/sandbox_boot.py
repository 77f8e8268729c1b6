"""Programs run inside the Python sandbox: the child's bootstrap and the PID namespace's init.

`BOOTSTRAP` runs as `python -I -S -c BOOTSTRAP <tmpdir> <cpu_s> <mem_bytes> <fsize_bytes>
<nproc> <hook 0|1> <landlock 0|1> <readable file>...` and reads the user's program from stdin.
Before the program runs it sets the resource limits, confines the process with Landlock (the
kernel then refuses every file access outside the temp dir except reads of the interpreter's
standard library and of the listed files, every exec, every TCP bind/connect, signals to
processes outside the sandbox and abstract unix sockets of others), removes ctypes again and
installs the audit hook. Landlock checks the file actually reached, whatever path or directory
fd led to it, so a rename race that fools the hook's textual `..` resolution gains nothing.
"""

BOOTSTRAP = r"""
def _boot():
    import sys, os, resource, gc
    gc_isenabled, gc_disable, gc_enable = gc.isenabled, gc.disable, gc.enable
    argv = sys.argv
    tmp = os.path.realpath(argv[1])
    cpu, mem, fsize, nproc = (int(a) for a in argv[2:6])
    use_hook, use_landlock = argv[6] == "1", argv[7] == "1"
    src = sys.stdin.buffer.read().decode("utf-8", "replace")
    with open(os.path.join(tmp, "main.py"), "w") as f:
        f.write(src)
    code = compile(src, "main.py", "exec")
    ro, ro_files, ro_list = _readable(sys.path)
    err = _confine(tmp, ro, ro_files + tuple(argv[9:]), ro_list, use_landlock,
                   bytes.fromhex(argv[8]))
    if err:
        sys.stderr.write("sandbox: cannot confine the program: " + err + "\n")
        sys.stderr.flush()
        os._exit(125)
    for lim, val in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem),
                     (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CORE, 0),
                     (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_NOFILE, 64)):
        resource.setrlimit(lim, (val, val))
    sep, lstat, readlink, stat_, getcwd = (
        os.sep, os.lstat, os.readlink, os.stat, os.getcwd)
    deny_prefix = ("subprocess.", "os.exec", "os.spawn", "os.posix_spawn", "ctypes.",
                   "socket.", "resource.", "gc.", "sys._current_frames", "pty.", "winreg.")
    deny = frozenset({
        "os.system", "os.fork", "os.forkpty", "os.link", "os.symlink", "os.chmod", "os.chown",
        "os.chdir", "os.chroot", "os.kill", "os.killpg", "sys.addaudithook", "os.putenv",
        "os.unsetenv", "mmap.__new__", "syslog.openlog", "fcntl.ioctl", "sys.settrace",
        "sys.setprofile", "os.startfile", "sys.setrecursionlimit",
        "function.__new__", "code.__new__",
        "cpython.run_command", "cpython.run_module", "cpython.run_file",
        "os.setuid", "os.setgid", "os.setsid", "os.setpgid", "signal.pthread_kill"})
    noimport = frozenset({
        "ctypes", "_ctypes", "socket", "_socket", "subprocess", "_posixsubprocess",
        "multiprocessing", "_multiprocessing", "mmap", "pty", "fcntl", "_ssl", "ssl", "signal",
        "_signal", "gc", "_posixshmem", "_testcapi", "_testinternalcapi", "resource",
        "_ctypes_test"})
    path_events = frozenset({
        "os.listdir", "os.scandir", "os.remove", "os.rmdir", "os.rename", "os.mkdir",
        "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "glob.glob", "os.walk",
        "shutil.move", "shutil.copytree"})
    list_events = frozenset({"os.listdir", "os.scandir", "glob.glob"})
    tmp_roots = (tmp,)

    def resolve(p):
        # Own resolver (C functions only): module attributes the user can patch are not used.
        # Only plain str/bytes: anything else could run user code inside the hook.
        if type(p) is int:
            return None
        if type(p) is bytes:
            p = p.decode("utf-8", "replace")
        elif type(p) is not str:
            raise PermissionError("sandbox: paths must be str or bytes")
        if not p.startswith(sep):
            p = getcwd() + sep + p
        todo, parts, hops = p.split(sep), [], 0
        while todo:
            c = todo.pop(0)
            if c in ("", "."):
                continue
            if c == "..":
                if parts:
                    parts.pop()
                continue
            cur = sep + sep.join(parts + [c])
            try:
                is_link = (lstat(cur).st_mode & 0o170000) == 0o120000
            except OSError:
                is_link = False
            if is_link:
                hops += 1
                if hops > 40:
                    return cur
                target = readlink(cur)
                if target.startswith(sep):
                    parts = []
                todo = target.split(sep) + todo
                continue
            parts.append(c)
        return sep + sep.join(parts)

    def inside(path, roots):
        return any(path == r or path.startswith(r + sep) for r in roots)

    def is_dir(path):
        try:
            return (stat_(path).st_mode & 0o170000) == 0o040000
        except OSError:
            return False

    def hook(event, args):
        # No garbage collection while checking: a finalizer of the user's could otherwise run
        # inside the hook and walk up to its frame.
        was_enabled = gc_isenabled()
        gc_disable()
        try:
            check(event, args)
        finally:
            if was_enabled:
                gc_enable()

    def check(event, args):
        if event in deny or event.startswith(deny_prefix):
            raise PermissionError(f"sandbox: {event} is not allowed")
        # frames (tracebacks, generators) would lead to the hook's own frame and closure
        if event == "object.__getattr__" and args[1] != "__code__":
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].split(".")[0] in noimport:
            raise ImportError(f"sandbox: import of {args[0]} is not allowed")
        if event == "open":
            path = resolve(args[0])
            if path is None:
                return
            mode, flags = args[1], args[2]
            writing = (mode is not None and any(c in mode for c in "wax+")) or (
                mode is None and bool(flags & 0o3 or flags & 0o100))
            if inside(path, tmp_roots):
                return
            # no directory fds outside: a dir_fd would let relative paths escape the check
            if not writing and (inside(path, ro) or path in ro_files) and not is_dir(path):
                return
            raise PermissionError(f"sandbox: access to {path!r} is denied")
        if event in path_events:
            for a in args[:2]:
                t = type(a)
                if t is str or t is bytes or not (t is int or t is bool or t is tuple or a is None):
                    path = resolve(a)
                    if not (inside(path, tmp_roots) or (event in list_events and (
                            inside(path, ro) or path in ro_list))):
                        raise PermissionError(f"sandbox: access to {path!r} is denied")

    import types
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    g = main.__dict__
    if use_hook:
        sys.addaudithook(hook)
    return code, g


def _readable(path):
    # The interpreter's directories on sys.path, readable by the program: (trees, single files,
    # directories whose names alone may be listed). A directory holding site-packages or
    # dist-packages (pyenv's stdlib) is split into its other entries: installed packages stay
    # out of reach.
    import os
    hidden = ("site-packages", "dist-packages")
    trees, files, listed = [], [], []
    for p in dict.fromkeys(os.path.realpath(p) for p in path if p and os.path.isdir(p)):
        names = os.listdir(p)
        if not any(h in names for h in hidden):
            trees.append(p)
            continue
        listed.append(p)
        for n in names:
            q = os.path.join(p, n)
            if n not in hidden:
                (trees if os.path.isdir(q) else files).append(os.path.realpath(q))
    return tuple(trees), tuple(files), tuple(listed)


def _confine(tmp, ro, files, ro_list, use_landlock, prog):
    # Landlock (when asked), then the seccomp filter `prog` (struct sock_filter[]). Returns ""
    # once the process is confined, else what failed. ctypes leaves sys.modules again before
    # the user's program runs (and the audit hook refuses its events anyway).
    import sys, os, ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        sc = libc.syscall
        sc.restype = ctypes.c_long
        err = _landlock(libc, sc, tmp, ro, files, ro_list) if use_landlock else ""
        if err:
            return "Landlock: " + err
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            return "PR_SET_NO_NEW_PRIVS: " + os.strerror(ctypes.get_errno())

        class FProg(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

        fprog = FProg(len(prog) // 8, prog)
        if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, MODE_FILTER
            return "seccomp: " + os.strerror(ctypes.get_errno())
        return ""
    finally:
        for name in [m for m in sys.modules if m in ("ctypes", "_ctypes")
                     or m.startswith("ctypes.")]:
            del sys.modules[name]


def _landlock(libc, sc, tmp, ro, files, ro_list):
    import os, ctypes, struct
    abi = sc(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, LANDLOCK_..._VERSION)
    if abi < 1:
        return os.strerror(ctypes.get_errno()) + " (no Landlock in this kernel)"
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
        return "landlock_create_ruleset: " + os.strerror(ctypes.get_errno())
    read_file, read_dir = 1 << 2, 1 << 3
    # temp dir: read, write, make and remove files and directories (no exec, devices,
    # sockets, fifos or symlinks); refer (renames between its directories), truncate
    rw = fs & ((1 << 1) | read_file | read_dir | (1 << 4) | (1 << 5) | (1 << 7) | (1 << 8)
               | (1 << 13) | (1 << 14))
    rules = [(tmp, rw)] + [(p, read_file | read_dir) for p in ro] + [
        (p, read_file) for p in files] + [(p, read_dir) for p in ro_list]
    for path, allowed in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        rule = ctypes.create_string_buffer(struct.pack("=Qi", allowed, fd), 12)
        r = sc(445, ctypes.c_long(rs), 1, rule, 0)  # LANDLOCK_RULE_PATH_BENEATH
        e = ctypes.get_errno()
        os.close(fd)
        if r < 0 and path == tmp:
            return "landlock_add_rule: " + os.strerror(e)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return "PR_SET_NO_NEW_PRIVS: " + os.strerror(ctypes.get_errno())
    if sc(446, ctypes.c_long(rs), 0) < 0:  # landlock_restrict_self
        return "landlock_restrict_self: " + os.strerror(ctypes.get_errno())
    os.close(rs)
    return ""

_c, _g = _boot()
del _boot, _readable, _confine, _landlock
exec(_c, _g)
"""

# Init of the PID namespace: in its own mount namespace, remount every mount read-only, hide
# the directories in $3 (':'-separated: the installed packages) under an empty tmpfs, mount
# a size-limited tmpfs (the working directory's byte quota) on the temp dir and enter it; then
# run the program and pass on its status. A mount that cannot be remounted (odd names) stays as
# it was; Landlock and the audit hook still cover it. Only ever run inside a new mount
# namespace. The tmpfs vanishes with the namespace, however the sandbox ends.
INIT = r"""
T=$1; Q=$2; H=$3; shift 3
while read -r _dev m _rest; do
    mount -o remount,bind,ro "$m" 2>/dev/null
done < /proc/self/mounts
IFS=:
for h in $H; do
    mount -t tmpfs -o "size=4k,nr_inodes=1,mode=0,ro,nosuid,nodev,noexec" hidden "$h" || exit 125
done
unset IFS
if ! mount -t tmpfs -o "size=$Q,nr_inodes=4096,mode=0700,nosuid,nodev,noexec" sandbox "$T"
then
    echo "sandbox: cannot mount the size-limited working directory" >&2
    exit 125
fi
cd "$T" || exit 1
"$@"; exit $?
"""

# First process of every run: dies with the trainer (PR_SET_PDEATHSIG, armed by the launcher in
# front of it; when the trainer was already gone before it was armed, stop here), joins the pids
# cgroup when there is one, then becomes the rest of the command.
LAUNCH = r"""
[ "$PPID" = "$1" ] || exit 125
if [ -n "$2" ]; then { echo $$ > "$2"; } 2>/dev/null; fi
shift 2; exec "$@"
"""

# The launcher where setpriv has no --pdeathsig: the same, from the interpreter itself.
PDEATHSIG_PY = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)

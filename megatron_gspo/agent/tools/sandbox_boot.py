"""Programs run inside the Python sandbox: the model's interpreter's bootstrap and the PID
namespace's init.

`BOOTSTRAP` is the final interpreter, exec'd by the first stage (`sandbox_stage.STAGE`) once the
kernel confines the process (new root, uid nobody, Landlock, seccomp): `python -I -S -c
BOOTSTRAP <tmpdir> <cpu_s> <mem_bytes> <fsize_bytes> <nproc> <hook 0|1>`, the user's program on
stdin. It never imports ctypes (`_ctypes` is neither loaded nor readable). Before the program
runs it sets the resource limits, loads the most used standard modules (`_PRELOAD`, from the
interpreter's read-only bytecode, while nothing of the user's has run) and installs the audit
hook, the convenience layer. From then on imports compile their source
(`sys.implementation.cache_tag = None`: no cached bytecode is read) and the hook refuses
marshal, so every code object that runs was compiled from source in the sandbox or came from
the interpreter's own files (issue 54, defect 1). Verifying each unmarshalled buffer against
the file instead would not hold: the audit event gets a copy, and a bytearray can change
between the check and the read.
"""

BOOTSTRAP = r"""
def _boot():
    import sys, os, resource, gc
    gc_isenabled, gc_disable, gc_enable = gc.isenabled, gc.disable, gc.enable
    argv = sys.argv
    tmp = os.path.realpath(argv[1])
    cpu, mem, fsize, nproc = (int(a) for a in argv[2:6])
    use_hook = argv[6] == "1"
    src = sys.stdin.buffer.read().decode("utf-8", "replace")
    with open(os.path.join(tmp, "main.py"), "w") as f:
        f.write(src)
    code = compile(src, "main.py", "exec")
    ro, ro_files, ro_list = _readable(sys.path)
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
        "function.__new__", "code.__new__", "marshal.loads", "marshal.load",
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
        # only code the compiler made runs: no code object of another function swapped in
        if event == "object.__setattr__" and args[1] == "__code__":
            raise PermissionError("sandbox: setting __code__ is not allowed")
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
    # modules programs use most, loaded from the interpreter's own (read-only) bytecode while
    # marshal is still trusted: later imports of them cost nothing
    for name in _PRELOAD:
        try:
            __import__(name)
        except Exception:
            pass
    if use_hook:
        # imports compile their source (no cached bytecode read, none written): marshal, the
        # one way to a code object the compiler did not make, is denied from here on
        sys.implementation.cache_tag = None
        sys.addaudithook(hook)
    return code, g


_PRELOAD = ("re", "json", "math", "collections", "itertools", "functools", "random", "string",
            "heapq", "bisect", "datetime", "fractions", "decimal", "statistics", "typing",
            "dataclasses", "textwrap", "copy", "enum")


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


_c, _g = _boot()
del _boot, _readable, _PRELOAD
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
# front of it; when the trainer was already gone before it was armed, stop here), joins the call's
# cgroups when there are (':'-separated cgroup.procs files; a join that fails stops the call:
# its limits would not hold), then becomes the rest of the command.
LAUNCH = r"""
[ "$PPID" = "$1" ] || exit 125
IFS=:
for p in $2; do
    if ! { echo $$ > "$p"; } 2>/dev/null; then
        echo "sandbox: cannot join the call's cgroup ($p)" >&2; exit 125
    fi
done
unset IFS
shift 2; exec "$@"
"""

# The launcher where setpriv has no --pdeathsig: the same, from the interpreter itself.
PDEATHSIG_PY = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)

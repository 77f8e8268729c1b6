"""Helper processes that end with the trainer, also when it is killed with SIGKILL.

Megatron-Core's torch_dist checkpoint writer (`dist_checkpointing/strategies/
filesystem_async.py`, `_get_write_results_queue`) starts a spawn-context
`multiprocessing.Manager` the first time a rank saves, to hold its results queue, and keeps it
for the life of the process. Python shuts that server down only from an `atexit` finalizer, so
a trainer that is killed (SIGKILL, SIGTERM) or leaves through `os._exit` orphans it (~270 MB,
plus the multiprocessing resource tracker it keeps alive).

`install_checkpoint_results_queue()` starts that Manager itself, with an initializer that asks
the kernel to kill the server when the trainer dies (Linux `PR_SET_PDEATHSIG`), and hands its
queue to Megatron's module-level cache, so Megatron never starts its own.

The same writer forks worker processes (`write_preloaded_data_multiproc`, fork context) that
report through a `JoinableQueue`; when the trainer is killed while it waits in that queue's
`join()`, a worker blocks for ever in `task_done()` (a multiprocessing Condition waits for
the dead sleeper to wake), and keeps the resource tracker alive with it.
`tie_forked_children()` registers an at-fork hook so every process this process forks from
its main thread gets `PR_SET_PDEATHSIG` too: a checkpoint that never got its COMPLETE marker
is worthless, so its writers end with the trainer.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from contextlib import contextmanager
from multiprocessing.managers import SyncManager

from megatron_gspo.runtime.exec_with_parent import die_with_parent

_state: dict = {"manager": None, "pid": None, "fork_hook": False}
_fork: dict = {"from_main": False, "parent": 0, "background": False}  # set before each fork
#: niceness of checkpoint work beside training (the writer processes, the publish thread): the
#: lowest CPU priority, so on cores that training keeps busy the writer yields to it and runs
#: in its gaps, while on a GPU node's idle host cores it runs at full speed all the same
BACKGROUND_NICE = 19


def _before_fork() -> None:
    _fork.update(from_main=threading.current_thread() is threading.main_thread(),
                 parent=os.getpid())


def _after_fork_in_child() -> None:
    if _fork["from_main"]:  # PR_SET_PDEATHSIG follows the forking thread: the main one lives
        die_with_parent(_fork["parent"])
    if _fork["background"]:
        lower_priority(0)


def lower_priority(tid: int | None = None) -> None:
    """Give a process (`tid` 0) or, on Linux, the calling thread (None) the background
    niceness; where that is not allowed, nothing changes."""
    who = threading.get_native_id() if tid is None else tid
    try:
        now = os.getpriority(os.PRIO_PROCESS, who)
        os.setpriority(os.PRIO_PROCESS, who, max(now, BACKGROUND_NICE))
    except (OSError, AttributeError):
        pass


@contextmanager
def background_children():
    """Processes forked inside this block run at the background niceness."""
    _fork["background"] = True
    try:
        yield
    finally:
        _fork["background"] = False


def tie_forked_children() -> None:
    """Every process later forked by this process's main thread (multiprocessing's fork
    context; not subprocess, which execs) is killed by the kernel when this process dies.
    Idempotent."""
    if not _state["fork_hook"]:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _state["fork_hook"] = True


def install_checkpoint_results_queue() -> bool:
    """Give Megatron's torch_dist writer a results queue whose server dies with this process.

    Call before the first `dist_checkpointing.save` in the thread that lives as long as the
    process (the main thread: PR_SET_PDEATHSIG follows the thread that started the child).
    Idempotent per process.

    Returns:
        True when the queue is (now) ours; False when Megatron already made its own or has no
        such cache (a different Megatron-Core version), in which case nothing changes.
    """
    if _state["manager"] is not None and _state["pid"] == os.getpid():
        return True
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa
    except ImportError:
        return False
    if not hasattr(fsa, "_results_queue") or fsa._results_queue is not None:
        return False
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    fsa._results_queue = manager.Queue()
    _state.update(manager=manager, pid=os.getpid())
    return True


def shutdown_checkpoint_results_queue() -> None:
    """Stop the Manager started by `install_checkpoint_results_queue` (no-op when none)."""
    manager = _state["manager"]
    if manager is None or _state["pid"] != os.getpid():
        return
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

        fsa._results_queue = None
    except ImportError:
        pass
    manager.shutdown()
    _state.update(manager=None, pid=None)

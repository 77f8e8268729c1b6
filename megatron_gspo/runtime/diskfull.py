"""One line instead of a traceback when a write fails because its file system is full.

The writers report a full disk in their own words: Python's `OSError` (errno ENOSPC / EDQUOT),
Megatron-Core's checkpoint workers ("Worker failure: [Errno 28] No space left on device"),
safetensors ("I/O error: No space left on device (os error 28)") and torch.save, whose zip
writer says only "[enforce fail at inline_container.cc:...] ... file write failed".
`disk_full` recognises these anywhere in an exception's chain and names the path, its mount
point and the space left there.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

__all__ = ["disk_full"]

_NO_SPACE = ("No space left on device", "os error 28", "[Errno 28]", "StorageFull",
             "Disk quota exceeded", "os error 122", "[Errno 122]")
_WRITE_FAILED = ("file write failed", "inline_container.cc")  # torch.save's zip writer


def _chain(exc: BaseException | None):
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _where(path: Path) -> tuple[str, str]:
    """(mount point, free space) of the file system that holds `path` (or would)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = f"{shutil.disk_usage(p).free / 2**20:.1f} MiB"
    except OSError:
        free = "unknown space"
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return str(p), free


def disk_full(exc: BaseException, path: str | os.PathLike) -> str | None:
    """A one-line message when `exc` (or an exception in its chain) is a write refused for lack
    of space while writing `path`; None for any other error.

    Args:
        exc: the exception a writer raised.
        path: what was being written (file or directory; need not exist any more).
    """
    why = None
    for e in _chain(exc):
        text = str(e)
        if (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
                m in text for m in _NO_SPACE):
            why = "no space left on the device"
            break
        if any(m in text for m in _WRITE_FAILED):
            why = "a file write failed (full disk or quota?)"
            break
    if why is None:
        return None
    mount, free = _where(Path(path))
    return (f"{why} while writing {path} (file system mounted at {mount}, {free} free now); "
            "free space there or write elsewhere")

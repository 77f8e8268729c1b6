"""Checkpoint files made durable and listed: fsync of files and folders, the sha256 manifest
that a COMPLETE marker holds (runtime/run_checkpoint.py), and the shared lock a reader holds on a
complete checkpoint so that rotation leaves it alone."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def list_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def manifest(folder: Path, checksums: bool) -> dict[str, list]:
    """{relative path: [size, sha256 or None]} of every file under `folder`, each file and
    folder fsynced first (durable before COMPLETE names it; a no-op for what is on disk)."""
    names = [n for n in list_files(folder) if n != "COMPLETE"]

    def entry(n: str) -> list:
        fsync_path(folder / n)
        return [(folder / n).stat().st_size, sha256_file(folder / n) if checksums else None]

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        entries = list(pool.map(entry, names))
    for d in {(folder / n).parent for n in names} | {folder}:
        fsync_path(d)
    return dict(zip(names, entries, strict=True))


@contextmanager
def hold_for_reading(step_dir: str | os.PathLike):
    """Keep a complete checkpoint from being rotated away while it is read: a shared `flock`
    on its COMPLETE marker, which `Checkpointer.rotate` respects (released on exit, also when
    the reader dies). Raises FileNotFoundError when the checkpoint is already gone."""
    import fcntl

    marker = Path(step_dir) / "COMPLETE"
    fd = os.open(marker, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if not marker.is_file() or os.stat(marker).st_ino != os.fstat(fd).st_ino:
            raise FileNotFoundError(f"{step_dir} was removed while it was being opened")
        yield Path(step_dir)
    finally:
        os.close(fd)


def being_read(step_dir: str | os.PathLike) -> bool:
    """A reader holds `hold_for_reading` on this checkpoint."""
    import fcntl

    try:
        fd = os.open(Path(step_dir) / "COMPLETE", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)

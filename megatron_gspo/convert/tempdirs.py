"""Owned temporary directories of conversions, and removal of those whose owner is gone.

A conversion writes its output under a hidden ``.<name>.tmp-<pid>`` directory next to the
target and renames it into place at the end. Each such directory holds an owner record (pid,
host, the process's start time): a conversion killed mid-write leaves its directory behind,
and the next conversion writing into the same parent directory removes it, with a message,
once its owner is known to be gone:

- same host: the owner pid no longer runs, or runs a different process (pid reused: the
  start time differs);
- another host (shared file system), or a leftover without an owner record (written by an
  older version, only for the target being written): nothing in it changed for
  `STALE_AFTER_S` seconds.

A live conversion's directory is never removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import time
from datetime import datetime
from pathlib import Path

import psutil

OWNER_FILE = ".megatron_gspo_owner.json"
STALE_AFTER_S = 24 * 3600
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)(-(?P<pid>\d+))?$")


def _start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def mark_owned(directory: Path) -> None:
    """Write this process's owner record into `directory`."""
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": _start_time(os.getpid()), "created": time.time()}
    (directory / OWNER_FILE).write_text(json.dumps(record))


def release(directory: Path) -> None:
    """Remove the owner record (before the directory becomes the finished output)."""
    (directory / OWNER_FILE).unlink(missing_ok=True)


def _read_owner(directory: Path) -> dict | None:
    try:
        record = json.loads((directory / OWNER_FILE).read_text())
        return record if isinstance(record, dict) and isinstance(record.get("pid"), int) else None
    except (OSError, ValueError):
        return None


def _last_change(directory: Path) -> float:
    """Newest modification time of the directory or anything under it."""
    newest = directory.stat().st_mtime
    for p in directory.rglob("*"):
        try:
            newest = max(newest, p.lstat().st_mtime)
        except OSError:
            pass
    return newest


def owner_gone(directory: Path, record: dict | None) -> str | None:
    """Why `directory`'s owner is known to be gone (a phrase for the message), else None."""
    if record is not None and record.get("host") == socket.gethostname():
        pid = record["pid"]
        if pid == os.getpid():
            return None
        started = _start_time(pid)
        if started is None:
            return f"pid {pid} on {record['host']} is no longer running"
        want = record.get("started")
        if isinstance(want, (int, float)) and abs(started - want) > 1.0:
            return f"pid {pid} on {record['host']} now belongs to another process"
        return None
    age = time.time() - _last_change(directory)
    if age > STALE_AFTER_S:
        who = f"pid {record['pid']} on {record.get('host')}" if record else "an unknown owner"
        return f"{who}, unchanged for {age / 3600:.0f} h"
    return None


def clean_stale(parent: Path, target_name: str | None = None) -> list[Path]:
    """Remove conversion temp directories under `parent` whose owner is gone.

    Args:
        parent: directory to scan (not recursive).
        target_name: name of the output about to be written; its leftovers without an owner
            record (``.<name>.tmp``, ``.<name>.tmp-<pid>``, ``.<name>.old-<pid>``) are also
            candidates (removed by age only).
    Returns:
        the removed directories (each announced with one line on stderr).
    """
    removed = []
    if not parent.is_dir():
        return removed
    for p in sorted(parent.iterdir()):
        m = _TEMP_RE.match(p.name)
        if m is None or p.is_symlink() or not p.is_dir():
            continue
        record = _read_owner(p)
        if record is None and m.group("name") != target_name:
            continue  # not provably ours
        why = owner_gone(p, record)
        if why is None:
            continue
        shutil.rmtree(p, ignore_errors=True)
        if p.exists():
            continue
        removed.append(p)
        when = ""
        if record and isinstance(record.get("created"), (int, float)):
            started = datetime.fromtimestamp(record["created"]).isoformat(" ", "seconds")
            when = f", started {started}"
        print(f"megatron_gspo.convert: removed {p}, left by an interrupted conversion "
              f"({why}{when})", file=sys.stderr)
    return removed


def make_temp_dir(target: Path, kind: str = "tmp") -> Path:
    """Create the owned hidden directory ``.<target name>.<kind>-<pid>`` next to `target`,
    after removing stale ones of dead conversions from the same parent.

    Returns:
        the new, empty directory (apart from its owner record).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(target.parent, target.name)
    tmp = target.parent / f".{target.name}.{kind}-{os.getpid()}"
    if tmp.exists():  # this process's own leftover
        shutil.rmtree(tmp)
    tmp.mkdir()
    mark_owned(tmp)
    return tmp

"""Crash recovery of a directory store: list its blobs and remove the temp files of dead writers.

A writer holds an exclusive ``flock`` on its temp file until the rename, so a
temp file is removed only when that lock is free and its writer's pid is dead
(or the file is older than ``stale_temp_s``: a pid reused by another process).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator

from .files import TMP_PREFIX, open_regular, pid_alive, try_lock
from .keys import is_key_name

__all__ = ["iter_blob_names", "remove_dead_temp", "scan"]


def scan(root: str, stale_temp_s: float) -> list[tuple[int, str, int]]:
    """``(mtime_ns, key, size)`` of every blob file directly in ``root``; dead temps removed on the way."""
    found: list[tuple[int, str, int]] = []
    with os.scandir(root) as it:
        for de in it:
            name = de.name
            if name.startswith(TMP_PREFIX):
                remove_dead_temp(root, name, stale_temp_s)
                continue
            if name.startswith(".") or not is_key_name(name):
                continue
            try:
                st = de.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                found.append((st.st_mtime_ns, name, st.st_size))
    return found


def iter_blob_names(root: str) -> Iterator[str]:
    """Keys of the blob files in ``root``, as the directory lists them (no index, bounded memory)."""
    with os.scandir(root) as it:
        for de in it:
            if de.name.startswith(".") or not is_key_name(de.name):
                continue
            try:
                if de.is_file(follow_symlinks=False):
                    yield de.name
            except OSError:
                continue


def remove_dead_temp(root: str, name: str, stale_temp_s: float) -> None:
    """Unlink the temp file ``name`` if its writer is gone (flock free, and pid dead or stale)."""
    path = os.path.join(root, name)
    parts = name[len(TMP_PREFIX) :].split(".")
    try:
        pid = int(parts[0])
    except (ValueError, IndexError):
        pid = -1
    try:
        opened = open_regular(path)
    except OSError:
        return
    if opened is None:  # a symlink or special file named like a temp: never ours, never followed
        return
    fd, _ = opened
    try:
        if not try_lock(fd):
            return  # a live writer holds it
        age = time.time() - os.fstat(fd).st_mtime
        if pid_alive(pid) and age < stale_temp_s:
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    finally:
        os.close(fd)

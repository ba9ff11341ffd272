"""Quarantine: where a directory store moves a blob file that failed verification.

A damaged file is renamed into ``root/.quarantine/`` (or deleted, when
quarantine is off) only if it is still the inode that was read: a writer that
replaced it meanwhile wins, and the caller may read the new blob.
"""

from __future__ import annotations

import os
import secrets
import time

from .files import fsync_dir, lstat, temp_name

__all__ = ["QUARANTINE_DIRNAME", "Quarantine"]

QUARANTINE_DIRNAME = ".quarantine"
"""Subdirectory of the store root that receives corrupt files."""


class Quarantine:
    """Moves (``enabled``) or deletes damaged files of the store at ``root``."""

    def __init__(self, root: str, *, enabled: bool = True, fsync: bool = True) -> None:
        self.root = root
        self.enabled = enabled
        self.fsync = fsync

    @property
    def dir(self) -> str:
        """``root/.quarantine``."""
        return os.path.join(self.root, QUARANTINE_DIRNAME)

    def prepare(self) -> None:
        """Create the quarantine folder now if possible (a read-only store retries when needed)."""
        if self.enabled:
            try:
                os.makedirs(self.dir, exist_ok=True)
            except OSError:
                pass

    def discard(self, path: str, st: os.stat_result) -> tuple[str, bool]:
        """Quarantine (or delete) ``path`` if it is still the inode ``st``.

        Returns what happened and whether a writer had replaced the file (so the
        caller may read the new one). A file renamed in between our check and
        our rename is put back with ``link`` (which never clobbers a newer one).
        """
        cur = lstat(path)
        if cur is None:
            return "file already gone", False
        if not os.path.samestat(cur, st):
            return "a writer has replaced it since", True
        dest = self._destination(path)
        try:
            os.rename(path, dest)
        except FileNotFoundError:
            return "file already gone", False
        try:
            moved = os.lstat(dest)
        except FileNotFoundError:  # a scanner removed our .tmp-named file: same outcome
            return "deleted", False
        if not os.path.samestat(moved, st):
            try:
                os.link(dest, path)
            except FileExistsError:
                pass
            os.unlink(dest)
            return "a writer has replaced it since", True
        if not self.enabled:
            os.unlink(dest)
            return "deleted", False
        if self.fsync:
            fsync_dir(self.dir)
            fsync_dir(self.root)
        return f"moved to {dest}", False

    def _destination(self, path: str) -> str:
        if not self.enabled:
            return os.path.join(self.root, temp_name())
        os.makedirs(self.dir, exist_ok=True)
        return os.path.join(self.dir, f"{os.path.basename(path)}.{time.time_ns()}.{secrets.token_hex(4)}")

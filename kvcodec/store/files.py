"""POSIX file primitives of the directory store: open a regular file only, read it, write a temp
file under ``flock``, fsync a directory, and remove exactly the file that was examined.

Nothing here knows about blobs or keys; every function is safe against a symlink,
FIFO or socket planted under a name (never followed, never blocking).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import threading

try:  # POSIX: flock tells a live writer's temp file from a dead one's.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "TMP_PREFIX",
    "create_temp",
    "fsync_dir",
    "lstat",
    "open_regular",
    "pid_alive",
    "read_into",
    "remove_exact",
    "same_file",
    "set_mtime",
    "temp_name",
    "try_lock",
    "write_all",
]

TMP_PREFIX = ".tmp."
"""Names of writes in progress (and of files renamed aside for removal): ``.tmp.<pid>.<tid>.<random>``."""

WRITE_CHUNK = 8 << 20
"""Most bytes per ``os.write`` call."""

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_MISS_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EMLINK, errno.ENXIO})
"""open() errors that mean "no regular file here": absent, a symlink (ELOOP; EMLINK on BSDs), a socket."""


def temp_name() -> str:
    """A fresh temp file name of this process and thread."""
    return f"{TMP_PREFIX}{os.getpid()}.{threading.get_native_id()}.{secrets.token_hex(8)}"


def open_regular(path: str) -> tuple[int, os.stat_result] | None:
    """``(fd, stat)`` of the regular file at ``path``, without following a symlink; None if there is none.

    ``O_NONBLOCK`` keeps a FIFO from hanging the open; ``fstat`` refuses
    whatever is not a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _O_NOFOLLOW | _O_CLOEXEC)
    except OSError as e:
        if e.errno in _MISS_ERRNOS:
            return None
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd, st


def read_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` starting at file ``offset``; the bytes read (fewer at end of file)."""
    got, n = 0, len(view)
    while got < n:
        k = os.preadv(fd, [view[got:] if got else view], offset + got)
        if k == 0:
            break
        got += k
    return got


def set_mtime(fd: int, ns: int) -> bool:
    """Set ``fd``'s atime and mtime to ``ns``; False where that is refused (not the owner, read-only mount)."""
    try:
        os.utime(fd, ns=(ns, ns))
    except OSError:
        return False
    return True


def lstat(path: str) -> os.stat_result | None:
    """``path``'s own stat (a symlink is not followed), or None if absent."""
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (pid namespace)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:  # pragma: no cover - e.g. platforms without signals
        return True
    return True


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    """Same inode, size and mtime: nobody rewrote or touched the file in between."""
    return os.path.samestat(a, b) and a.st_size == b.st_size and a.st_mtime_ns == b.st_mtime_ns


def try_lock(fd: int) -> bool:
    """Take ``fd``'s exclusive ``flock`` without waiting; False if another holder has it."""
    if fcntl is None:  # pragma: no cover - Windows: no way to tell, assume free
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def create_temp(root: str) -> tuple[int, str]:
    """Create, open and flock a fresh temp file in ``root``; return ``(fd, path)``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC
    for _ in range(100):
        path = os.path.join(root, temp_name())
        try:
            fd = os.open(path, flags, 0o644)
        except FileExistsError:  # pragma: no cover - 64 random bits collided
            continue
        if fcntl is None:  # pragma: no cover - Windows
            return fd, path
        fcntl.flock(fd, fcntl.LOCK_EX)
        # A scanner may have removed the file between O_EXCL and flock
        # (only possible when it thinks our pid is dead): check it is still ours.
        try:
            same = os.path.samestat(os.lstat(path), os.fstat(fd))
        except FileNotFoundError:
            same = False
        if same:
            return fd, path
        os.close(fd)  # pragma: no cover - lost the race with a scanner; retry
    raise OSError(errno.EEXIST, "could not create a unique temp file", root)  # pragma: no cover


def write_all(fd: int, data: memoryview) -> None:
    """Write all of ``data`` (in steps of at most :data:`WRITE_CHUNK` bytes)."""
    off, n = 0, len(data)
    while off < n:
        off += os.write(fd, data[off : off + WRITE_CHUNK])


def fsync_dir(path: str) -> None:
    """fsync a directory (its entries' renames and unlinks), where the platform allows it."""
    try:
        dfd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - platforms that cannot open directories
        return
    try:
        os.fsync(dfd)
    except OSError:  # pragma: no cover - filesystems without directory fsync
        pass
    finally:
        os.close(dfd)


def remove_exact(root: str, path: str, st: os.stat_result) -> bool:
    """Unlink ``path`` only if it is still the file examined as ``st`` (inode, size, mtime).

    It is renamed aside (into ``root`` under a temp name) first and compared
    there: a blob that another process put (or read, when that refreshed its mtime)
    after the examination is linked back under its name (never over a newer one)
    instead of being deleted.
    """
    aside = os.path.join(root, temp_name())
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    try:
        moved = os.lstat(aside)
    except FileNotFoundError:  # a scanner removed the stale, renamed file: it was the old one
        return True
    if same_file(moved, st):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)
        return True
    with contextlib.suppress(FileExistsError, FileNotFoundError):
        os.link(aside, path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(aside)
    return False

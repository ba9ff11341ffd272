"""Bounds on what saves hold between the cache and the store: host bytes, and a skip log.

:class:`PendingBytes` counts the host memory of chunks copied out of the cache and not yet
written. A copy that may wait (the gatherer thread's) waits for room; one that may not (inside
the step) takes room or is skipped. :class:`SkipLog` turns skips into one WARNING per interval
with the count, so a steady loss is visible without a line per chunk.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["SKIP_LOG_INTERVAL_S", "PendingBytes", "SkipLog"]

logger = logging.getLogger("vllm.kvcodec")

SKIP_LOG_INTERVAL_S = 10.0
"""At most one WARNING about skipped saves per this many seconds."""


class PendingBytes:
    """Host bytes held by gathered, unwritten chunks, at most ``limit`` (one chunk larger than the
    limit is let through when nothing else is held, so it is never refused forever)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held = 0
        self._closed = False
        self._cond = threading.Condition()

    @property
    def held(self) -> int:
        with self._cond:
            return self._held

    def _fits(self, n: int) -> bool:
        return self._held == 0 or self._held + n <= self.limit

    def try_take(self, n: int) -> bool:
        """Take ``n`` bytes if they fit now (True), else take nothing (False)."""
        with self._cond:
            if self._closed or not self._fits(n):
                return False
            self._held += n
            return True

    def take(self, n: int, on_wait: Callable[[], None] | None = None) -> bool | None:
        """Wait until ``n`` bytes fit and take them: True at once, False after waiting, None when
        closed meanwhile (nothing taken). ``on_wait`` runs once, when the wait begins (so a wait
        still in progress is already counted)."""
        with self._cond:
            waited = False
            while not self._closed and not self._fits(n):
                if not waited and on_wait is not None:
                    on_wait()
                waited = True
                self._cond.wait()
            if self._closed:
                return None
            self._held += n
            return not waited

    def give(self, n: int) -> None:
        """Return ``n`` bytes taken before."""
        with self._cond:
            self._held -= n
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter; later takes fail."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class SkipLog:
    """Rate-limited WARNING for chunks not saved: the first at once, then one per interval with the
    count since the last."""

    def __init__(self, interval_s: float = SKIP_LOG_INTERVAL_S, counter: str = "saves_skipped") -> None:
        self._interval = interval_s
        self._counter = counter
        self._lock = threading.Lock()
        self._unlogged = 0
        self._last: float | None = None

    def skipped(self, why: str) -> None:
        """Note one chunk not saved, and log if the interval has passed."""
        now = time.monotonic()
        with self._lock:
            self._unlogged += 1
            if self._last is not None and now - self._last < self._interval:
                return
            count, self._unlogged, self._last = self._unlogged, 0, now
        logger.warning("kvcodec: %d chunk save(s) skipped: %s (counter %s)", count, why, self._counter)

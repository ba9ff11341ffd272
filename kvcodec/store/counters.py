"""The cumulative counters every store reports as ``stats()`` (the keys of ``STORE_COUNTERS``)."""

from __future__ import annotations

import threading

from .base import STORE_COUNTERS

__all__ = ["Counters"]


class Counters:
    """Thread-safe running totals, one per name of :data:`~kvcodec.store.STORE_COUNTERS`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(STORE_COUNTERS, 0.0)

    def add(self, **amounts: float) -> None:
        """Add to the named counters (each a name of STORE_COUNTERS)."""
        with self._lock:
            for name, n in amounts.items():
                self._values[name] += n

    def hit(self, n_bytes: int) -> None:
        """One read that found its blob: a round trip, a hit and its ``n_bytes`` (``add`` without kwargs)."""
        with self._lock:
            values = self._values
            values["round_trips"] += 1
            values["hits"] += 1
            values["bytes_read"] += n_bytes

    def snapshot(self) -> dict[str, float]:
        """A copy of every counter, in :data:`STORE_COUNTERS` order."""
        with self._lock:
            return dict(self._values)

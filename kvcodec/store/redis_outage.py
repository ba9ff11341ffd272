"""Which targets of a Redis store are out (the server, or cluster nodes), and when each may be probed.

While a target is marked down after a timeout, a call to it fails at once (no I/O: a silent server
would otherwise cost every call its full timeout), except one call per :data:`PROBE_INTERVAL_S`,
which goes through as the probe: its answer ends the outage, its failure keeps it. A target that
refused at once (connection refused: no wait) is probed by the next call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator

__all__ = ["PROBE_INTERVAL_S", "Outages"]

PROBE_INTERVAL_S = 1.0
"""Seconds between the calls let through to a target that is down (each a probe of it)."""

_ASK_NOW = float("-inf")
"""The probe time of a target that refused at once: every call may ask it (no wait to save)."""


class Outages:
    """Thread-safe set of down targets, each with the time (monotonic) of its last failure or probe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._due: dict[str, float] = {}
        """Target -> when it last failed or was probed; the next probe is due one interval later."""

    def __bool__(self) -> bool:
        return bool(self._due)

    def __contains__(self, target: object) -> bool:
        return target in self._due

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(sorted(self._due))

    def blocked(self, targets: Iterable[str]) -> str | None:
        """The first of ``targets`` that is down and not due for a probe (the call must fail at once),
        or None: the call may go on; a due target's next probe is then one interval from now (this
        call is its probe, concurrent ones still fail fast)."""
        now = time.monotonic()
        with self._lock:
            down = [t for t in targets if t in self._due]
            for target in down:
                if now - self._due[target] < PROBE_INTERVAL_S:
                    return target
            for target in down:  # a costly outage's probe: alone for one interval
                if self._due[target] != _ASK_NOW:
                    self._due[target] = now
        return None

    def failed(self, target: str, costly: bool = True) -> bool:
        """Mark ``target`` down; True when this starts its outage. ``costly`` (the failure took its
        timeout): calls fail fast until the next probe; else (refused at once, no wait) the next call
        may probe at once: a dead server costs nothing to ask, and a restarted one serves at once."""
        with self._lock:
            first = target not in self._due
            self._due[target] = time.monotonic() if costly else _ASK_NOW
        return first

    def mend(self, back: Iterable[str] | None) -> list[str]:
        """End the outages of ``back`` (None: all of them); the targets whose outage ended, sorted."""
        with self._lock:
            ended = set(self._due) if back is None else set(self._due) & set(back)
            for target in ended:
                del self._due[target]
        return sorted(ended)

    def rename(self, old: str, new: str) -> None:
        """Carry an outage recorded under ``old`` over to ``new`` (the store's name once connected)."""
        with self._lock:
            if old in self._due:
                self._due[new] = self._due.pop(old)

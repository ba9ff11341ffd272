"""The connector's counters: cumulative for tests and logs, per interval for vLLM's metrics hooks
(:mod:`.stats`). Pure Python, so the scheduler side counts without vLLM.

Every counter is a sum over the interval (and over workers when vLLM aggregates them); the gauges
are the largest value seen; ``load_seconds`` and ``save_seconds`` are summed background time spent
reading+checking and encoding+writing chunks.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from kvcodec.store import STORE_COUNTERS
from kvcodec.store.tiers import TIER_COUNTERS

__all__ = ["COUNTERS", "GAUGES", "STORE_STATS", "Counters"]

COUNTERS = (
    "tokens_hit",
    "tokens_missed",
    "tokens_loaded",
    "requests_loaded_async",
    "chunks_loaded",
    "chunks_loaded_fused",
    "chunks_loaded_other_split",
    "chunks_failed",
    "chunks_saved",
    "chunks_saved_fused",
    "blobs_saved",
    "save_errors",
    "saves_skipped",
    "saves_waited",
    "save_unavailable",
    "lookup_unavailable",
    "load_unavailable",
    "loads_deferred",
    "lookup_calls",
    "store_full",
    "requests_held",
    "requests_preempted",
    "bytes_read",
    "bytes_read_other_heads",
    "bytes_written",
    "load_seconds",
    "save_seconds",
    "start_load_kv_seconds",
    "wait_for_save_seconds",
    "get_finished_seconds",
    "handle_preemptions_seconds",
    "idle_load_wait_seconds",
)
"""Summed: lookups (tokens the connector serves / prompt tokens neither it nor vLLM's own cache had),
chunk loads and failures, chunk saves (``saves_skipped``: a copy out of the cache found the pending-save
memory full and could not wait; ``saves_waited``: chunks left in the cache, their blocks held, until
that memory freed; ``store_full``: the
capped store had no room without evicting the chunk's own prefix; ``requests_held``: finished requests whose
blocks vLLM kept until the writer had copied their chunks out; ``requests_preempted``: preemptions the
worker saw), blob bytes, background seconds
(``load_seconds``, ``save_seconds``) and the seconds the engine step spent inside each hook
(``idle_load_wait_seconds``: of ``get_finished``'s, waiting for the loader in steps that computed nothing).
``*_unavailable``: lookups (answered as misses), saves (dropped) and loads (recomputed) that found the
store unreachable (lookups: or failing in any other way, e.g. an I/O error); ``loads_deferred``: lookups answered "later" at ``max_concurrent_loads``;
``lookup_calls``: the scheduler side's ``contains_many`` calls (one round trip each on a remote store);
``chunks_loaded_other_split``: chunks a rank read from blobs of another head split (written at another
tensor-parallel size), of whose ``bytes_read`` ``bytes_read_other_heads`` held heads the rank does not
hold (read, checked, not used)."""
GAUGES = ("writer_queue_depth", "pending_save_bytes")
"""The largest seen in the interval: chunks waiting for a copy or a write; host bytes they hold."""
STORE_STATS = tuple(f"store_{name}" for name in STORE_COUNTERS)
"""The store's own counters (:meth:`~kvcodec.store.BlobStore.stats`), summed per interval like ours."""
TIER_NAMES = ("ram", "disk", "remote")
TIER_STATS = tuple(
    f"store_{tier}_{name}" for tier in TIER_NAMES for name in (*STORE_COUNTERS, *TIER_COUNTERS)
)
"""With store tiers, each tier's own counters and what the tiers did with it (``served``: chunk reads it
answered, ``promoted``: blobs copied into it, ``damaged``, ``unavailable``, ``write_failures``)."""


class Counters:
    """Thread-safe connector counters: cumulative (``total``, for tests and logs) and per interval."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total: dict[str, float] = dict.fromkeys(COUNTERS + GAUGES, 0)
        self._interval: dict[str, float] = {}
        self._store_seen: dict[str, float] = {}

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.total[k] = self.total.get(k, 0) + v
                self._interval[k] = self._interval.get(k, 0) + v

    def gauge(self, name: str, value: float) -> None:
        with self._lock:
            self.total[name] = value
            self._interval[name] = max(self._interval.get(name, 0), value)

    def merge_store(self, stats: Mapping[str, float]) -> None:
        """Take the store's cumulative counters in as ``store_<name>``: totals as they are, the
        interval by what grew since the last merge."""
        with self._lock:
            for name, value in stats.items():
                key = f"store_{name}"
                grown = value - self._store_seen.get(key, 0)
                self._store_seen[key] = value
                self.total[key] = value
                if grown:
                    self._interval[key] = self._interval.get(key, 0) + grown

    def take_interval(self) -> dict[str, float]:
        """What changed since the last call (empty: nothing)."""
        with self._lock:
            out, self._interval = self._interval, {}
        return out

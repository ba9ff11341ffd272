"""The connector's counters, in vLLM's metrics hooks (``KVConnectorStats``, Prometheus).

Every counter is a sum over the interval (and over workers when vLLM
aggregates them); ``writer_queue_depth`` is a gauge (the largest seen);
``load_seconds`` and ``save_seconds`` are summed background time spent
reading+checking and encoding+writing chunks.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

__all__ = ["COUNTERS", "GAUGES", "Counters", "KvcodecPromMetrics", "KvcodecStats"]

COUNTERS = (
    "tokens_hit",
    "tokens_missed",
    "tokens_loaded",
    "requests_loaded_async",
    "chunks_loaded",
    "chunks_loaded_fused",
    "chunks_failed",
    "chunks_saved",
    "chunks_saved_fused",
    "blobs_saved",
    "save_errors",
    "saves_skipped",
    "store_full",
    "requests_held",
    "requests_preempted",
    "bytes_read",
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
chunk loads and failures, chunk saves (``saves_skipped``: the writer queue was full; ``store_full``: the
capped store had no room without evicting the chunk's own prefix; ``requests_held``: finished requests whose
blocks vLLM kept until the writer had copied their chunks out; ``requests_preempted``: preemptions the
worker saw), blob bytes, background seconds
(``load_seconds``, ``save_seconds``) and the seconds the engine step spent inside each hook
(``idle_load_wait_seconds``: of ``get_finished``'s, waiting for the loader in steps that computed nothing)."""
GAUGES = ("writer_queue_depth",)


class Counters:
    """Thread-safe connector counters: cumulative (``total``, for tests and logs) and per interval."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total: dict[str, float] = dict.fromkeys(COUNTERS + GAUGES, 0)
        self._interval: dict[str, float] = {}

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.total[k] += v
                self._interval[k] = self._interval.get(k, 0) + v

    def gauge(self, name: str, value: float) -> None:
        with self._lock:
            self.total[name] = value
            self._interval[name] = max(self._interval.get(name, 0), value)

    def take_interval(self) -> dict[str, float]:
        """What changed since the last call (empty: nothing)."""
        with self._lock:
            out, self._interval = self._interval, {}
        return out


class KvcodecStats(KVConnectorStats):
    """One interval's counters; vLLM sums them across workers and logs :meth:`reduce`."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            if k in GAUGES:
                self.data[k] = max(self.data.get(k, 0), v)
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvcodecPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters ``vllm:kvcodec_<name>_total`` and the gauge ``vllm:kvcodec_writer_queue_depth``."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {name: self._make(self._counter_cls, name) for name in COUNTERS}
        self._gauges = {
            name: self._make(self._gauge_cls, name, multiprocess_mode="mostrecent") for name in GAUGES
        }

    def _make(self, cls: Any, name: str, **kwargs: Any) -> dict[int, Any]:
        doc = f"KvcodecConnector {name.replace('_', ' ')}"
        return self._per_engine(
            cls(name=f"vllm:kvcodec_{name}", documentation=doc, labelnames=self._labelnames, **kwargs)
        )

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self._counters and value:
                self._counters[name][engine_idx].inc(value)
            elif name in self._gauges:
                self._gauges[name][engine_idx].set(value)

"""The connector's counters (:mod:`.counters`) in vLLM's metrics hooks: ``KVConnectorStats`` per
interval, summed across workers, and Prometheus (``store_*``: the store's own counters, and with store
tiers each tier's as ``store_<tier>_*``)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .counters import COUNTERS, GAUGES, STORE_STATS, TIER_STATS

__all__ = ["KvcodecPromMetrics", "KvcodecStats"]


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
    """Prometheus counters ``vllm:kvcodec_<name>_total`` (``store_*`` among them) and the gauges."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._make(self._counter_cls, name) for name in COUNTERS + STORE_STATS + TIER_STATS
        }
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

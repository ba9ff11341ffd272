"""Bench-only connectors: the real ones, with every hook the engine step waits on timed.

``TimedKvcodecConnector`` is :class:`~kvcodec.integrations.vllm.KvcodecConnector` and
``TimedExampleConnector`` is vLLM's own ``ExampleConnector``, each unchanged except
that every call of a step hook is timed into a :class:`HookClock`. Load them with
``"kv_connector_module_path": "bench.engine.timed_connector"`` (the repository root on
``PYTHONPATH``) and ``"kv_connector": "TimedKvcodecConnector"``.

Two settings come from the environment, since the connector refuses extra-config keys
it does not know (and the bench must not change what it measures):

- ``KVCODEC_BENCH_STORE_MBPS``: every :meth:`DirectoryStore.put` in this process first
  waits for a shared link of that many MB/s (10^6 bytes) to carry the blob, as a
  network store would; with ``"fsync": true`` in the extra config, the slow durable
  store of the benchmark.
- ``KVCODEC_BENCH_HOOKS_JSON``: at ``shutdown`` (and at exit) the clocks of every
  instance in this process are written there as JSON; :func:`dump` writes them on request.

The engine runner (``run_bench_engine.py``) runs vLLM in-process and reads
:data:`CLOCKS` before and after each engine step, so it sees per-step hook time.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

from kvcodec.format import as_bytes_view
from kvcodec.integrations.vllm.connector import KvcodecConnector
from kvcodec.store import DirectoryStore

__all__ = [
    "CLOCKS",
    "HOOKS_JSON_ENV",
    "SCHEDULER_HOOKS",
    "STORE_MBPS_ENV",
    "WORKER_HOOKS",
    "HookClock",
    "TimedExampleConnector",
    "TimedKvcodecConnector",
    "WriteThrottle",
    "dump",
    "throttle_store_writes",
]

HOOKS_JSON_ENV = "KVCODEC_BENCH_HOOKS_JSON"
STORE_MBPS_ENV = "KVCODEC_BENCH_STORE_MBPS"

WORKER_HOOKS = (
    "handle_preemptions",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
)
"""Called by the model runner inside every step; the forward pass waits for each."""
IDLE_WAIT = "idle_load_wait"
"""Not a hook: the part of ``get_finished`` spent waiting for the loader in steps that computed nothing."""
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
)
"""Called by the scheduler, on the same step's critical path (the lookup is the first)."""


class HookClock:
    """Cumulative seconds and calls per hook of one connector instance (one role)."""

    def __init__(self, connector: str, role: str) -> None:
        self.connector = connector
        self.role = role
        self.seconds = dict.fromkeys(WORKER_HOOKS + SCHEDULER_HOOKS, 0.0)
        self.calls = dict.fromkeys(WORKER_HOOKS + SCHEDULER_HOOKS, 0)
        self.cpu = dict.fromkeys(WORKER_HOOKS + SCHEDULER_HOOKS, 0.0)
        """CPU seconds of the calling thread inside each hook: the hook's own work, whatever else the machine runs."""
        self.stats: Any = None
        """The connector's own ``stats`` (read at snapshot time), when it keeps a dict of them."""
        self.lookups: list[dict[str, Any]] = []
        """Every ``get_num_new_matched_tokens`` call: seconds, prompt tokens, tokens computed locally, answer."""

    @contextmanager
    def timing(self, hook: str) -> Iterator[None]:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.seconds[hook] += time.perf_counter() - t0
            self.cpu[hook] += time.thread_time() - c0
            self.calls[hook] += 1

    def snapshot(self) -> dict[str, Any]:
        stats = self.stats() if callable(self.stats) else None
        return {
            "connector": self.connector,
            "role": self.role,
            "seconds": dict(self.seconds),
            "cpu": dict(self.cpu),
            "calls": dict(self.calls),
            "stats": stats,
            "lookups": list(self.lookups),
        }


CLOCKS: list[HookClock] = []
"""Every timed connector instance made in this process, in order of creation."""


def dump(path: str | None = None) -> str | None:
    """Write every clock's snapshot to ``path`` (default: ``$KVCODEC_BENCH_HOOKS_JSON``); return the path."""
    path = path or os.environ.get(HOOKS_JSON_ENV)
    if not path:
        return None
    with open(path + ".tmp", "w") as f:
        json.dump([c.snapshot() for c in CLOCKS], f, indent=1)
    os.replace(path + ".tmp", path)
    return path


atexit.register(dump)


class WriteThrottle:
    """One link of ``bytes_per_s`` shared by every writing thread: a write of n bytes waits its turn on it."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = float(bytes_per_s)
        self._lock = threading.Lock()
        self._free_at = 0.0

    def wait(self, nbytes: int) -> None:
        """Sleep until the link has carried ``nbytes`` after whatever it carries already."""
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + nbytes / self.bytes_per_s
            until = self._free_at
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def throttle_store_writes(mb_per_s: float) -> None:
    """Make every ``DirectoryStore.put`` in this process go through one shared ``mb_per_s`` link (idempotent)."""
    if getattr(DirectoryStore.put, "bench_throttle", None) is not None:
        return
    link = WriteThrottle(mb_per_s * 1e6)
    real_put = DirectoryStore.put

    @functools.wraps(real_put)
    def put(self: DirectoryStore, key: str, blob: Any) -> None:
        link.wait(len(as_bytes_view(blob)))
        real_put(self, key, blob)

    put.bench_throttle = link  # type: ignore[attr-defined]
    DirectoryStore.put = put  # type: ignore[method-assign]


class _HookTimer:
    """Mixin: each step hook of the connector below it in the MRO, timed."""

    def _start_clock(self, role: Any) -> None:
        self.bench_clock = HookClock(type(self).__name__, getattr(role, "name", str(role)))
        self.bench_clock.stats = self._own_stats
        CLOCKS.append(self.bench_clock)

    def _own_stats(self) -> dict[str, Any] | None:
        """The connector's ``stats`` dict as it is now (None when it keeps none)."""
        own = getattr(self, "stats", None)
        return dict(own) if isinstance(own, dict) else None

    # worker side
    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        with self.bench_clock.timing("handle_preemptions"):
            return super().handle_preemptions(kv_connector_metadata)  # type: ignore[misc]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        with self.bench_clock.timing("start_load_kv"):
            return super().start_load_kv(forward_context, **kwargs)  # type: ignore[misc]

    def wait_for_layer_load(self, layer_name: str) -> None:
        with self.bench_clock.timing("wait_for_layer_load"):
            return super().wait_for_layer_load(layer_name)  # type: ignore[misc]

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        with self.bench_clock.timing("save_kv_layer"):
            return super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)  # type: ignore[misc]

    def wait_for_save(self) -> None:
        with self.bench_clock.timing("wait_for_save"):
            return super().wait_for_save()  # type: ignore[misc]

    def get_finished(self, finished_req_ids: set[str]) -> Any:
        """Timed, less any wait for the loader in a step that computed nothing (kvcodec's
        ``idle_load_wait_seconds``): kept apart as ``idle_load_wait``, since no work waited on it."""
        waited0 = self._idle_waited()
        with self.bench_clock.timing("get_finished"):
            out = super().get_finished(finished_req_ids)  # type: ignore[misc]
        waited = self._idle_waited() - waited0
        seconds = self.bench_clock.seconds
        seconds["get_finished"] -= waited
        seconds[IDLE_WAIT] = seconds.get(IDLE_WAIT, 0.0) + waited
        return out

    def _idle_waited(self) -> float:
        counters = getattr(self, "counters", None)
        return counters.total.get("idle_load_wait_seconds", 0.0) if counters is not None else 0.0

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        t0 = time.perf_counter()
        with self.bench_clock.timing("get_num_new_matched_tokens"):
            answer = super().get_num_new_matched_tokens(request, num_computed_tokens)  # type: ignore[misc]
        self.bench_clock.lookups.append(
            {
                "seconds": time.perf_counter() - t0,
                "prompt": len(request.prompt_token_ids or ()),
                "local": num_computed_tokens,
                "answer": answer[0],
            }
        )
        return answer

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        with self.bench_clock.timing("update_state_after_alloc"):
            return super().update_state_after_alloc(request, blocks, num_external_tokens)  # type: ignore[misc]

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        with self.bench_clock.timing("build_connector_meta"):
            return super().build_connector_meta(scheduler_output)  # type: ignore[misc]

    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        with self.bench_clock.timing("request_finished"):
            return super().request_finished(request, block_ids)  # type: ignore[misc]

    def shutdown(self) -> None:
        try:
            super().shutdown()  # type: ignore[misc]
        finally:
            dump()


class TimedKvcodecConnector(_HookTimer, KvcodecConnector):
    """KvcodecConnector, hooks timed; ``$KVCODEC_BENCH_STORE_MBPS`` throttles its store's writes."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        mbps = os.environ.get(STORE_MBPS_ENV)
        if mbps:
            throttle_store_writes(float(mbps))
        super().__init__(vllm_config, role, kv_cache_config)
        self._start_clock(role)


class TimedExampleConnector(_HookTimer, ExampleConnector):
    """vLLM's ExampleConnector (safetensors files per layer and prompt), hooks timed."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._start_clock(role)

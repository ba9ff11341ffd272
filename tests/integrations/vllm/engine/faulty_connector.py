"""``KvcodecConnector`` with faults injected through :class:`ConnectorParts`, for ``run_engine.py``.

``run_engine.py`` fills :data:`FAULTS` before the engine starts and names this module as the
connector's ``kv_connector_module_path``; vLLM then builds this class (scheduler and worker side)
with the faults in place: a slow store (``slow_put_s`` before every write), a read path that raises
(``fail_get``: any read of a key containing that text), a slow copy out of the cache
(``slow_gather_s``). Nothing in the package is patched.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvcodec.integrations.vllm import connector as base
from kvcodec.integrations.vllm.config import KvcodecConfig
from kvcodec.integrations.vllm.layout import gather_kv
from kvcodec.integrations.vllm.worker import ConnectorParts
from kvcodec.store import BlobStore

__all__ = ["FAULTS", "FaultyStore", "KvcodecConnector"]

FAULTS: dict[str, Any] = {}
"""``slow_put_s``, ``fail_get``, ``slow_gather_s``: set by the engine runner."""


class FaultyStore:
    """A store whose writes first sleep ``slow_put_s`` and whose reads of keys containing
    ``fail_get`` raise RuntimeError (a bug in the read path, not a bad blob)."""

    def __init__(self, inner: BlobStore, slow_put_s: float = 0.0, fail_get: str | None = None) -> None:
        self.inner, self.slow_put_s, self.fail_get = inner, slow_put_s, fail_get

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _read(self, key: str) -> None:
        if self.fail_get and self.fail_get in key:
            raise RuntimeError(f"injected read failure for {key}")

    def get(self, key: str, **kw: Any) -> Any:
        self._read(key)
        return self.inner.get(key, **kw)

    def get_parsed(self, key: str, into: bytearray | None = None, **kw: Any) -> Any:
        """The inner store's, ``verify_crc`` and ``max_bytes`` (the BlobStore Protocol's) passed on."""
        self._read(key)
        return self.inner.get_parsed(key, into=into, **kw)

    def get_parsed_many(self, keys: Sequence[str], **kw: Any) -> list[Any]:
        for key in keys:
            self._read(key)
        return self.inner.get_parsed_many(keys, **kw)

    def put(self, key: str, blob: Any) -> None:
        time.sleep(self.slow_put_s)
        self.inner.put(key, blob)

    def put_many(self, items: Sequence[tuple[str, Any]]) -> None:
        for key, blob in items:
            self.put(key, blob)


def _slow_gather(seconds: float) -> Any:
    def gather(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return gather_kv(*args, **kwargs)

    return gather


class KvcodecConnector(base.KvcodecConnector):
    """The connector with :data:`FAULTS` injected."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        cfg = KvcodecConfig.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        store = FaultyStore(
            base.open_connector_store(cfg), FAULTS.get("slow_put_s", 0.0), FAULTS.get("fail_get")
        )
        slow = FAULTS.get("slow_gather_s")
        parts = ConnectorParts(store=store, gather=_slow_gather(slow) if slow else gather_kv)  # type: ignore[arg-type]
        super().__init__(vllm_config, role, kv_cache_config, parts=parts)

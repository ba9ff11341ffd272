"""A ``KvcodecConnector`` built as vLLM builds one, without an engine: the worker side with small CPU
caches registered (two layers, two chunks of two blocks), or the scheduler side, for tests that drive
the hooks directly, as vLLM's model runner and scheduler call them. What a test replaces (the store,
the copy out of the cache, the write into it) goes in through :class:`ConnectorParts`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvcodec.integrations.vllm.chunk_keys import group_of, is_manifest
from kvcodec.integrations.vllm.connector import KvcodecConnector
from kvcodec.integrations.vllm.keys import prefix_hashes
from kvcodec.integrations.vllm.worker import ConnectorParts
from kvcodec.store import DirectoryStore, StoreOptions

__all__ = [
    "BLOCK",
    "BLOCK_IDS",
    "CHUNK",
    "HASHES",
    "HEAD",
    "LAYERS",
    "TOKENS",
    "HookedStore",
    "connector",
    "cpu_worker",
]

CHUNK = 32
BLOCK = 16
HEADS = 2
HEAD = 64
LAYERS = 2
TOKENS = list(range(5, 5 + 2 * CHUNK))
HASHES = prefix_hashes(TOKENS, CHUNK)
BLOCK_IDS = [3, 1, 4, 0]
"""Two chunks of two 16-token blocks each."""
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]

Hook = Callable[[str], None] | None


class HookedStore:
    """The connector's directory store, whose reads and writes first call ``on_read(key)`` /
    ``on_write(key)`` (which may raise or wait); ``None``: no hook. Everything else is the store's."""

    def __init__(self, root: Path, on_read: Hook = None, on_write: Hook = None) -> None:
        self.inner = DirectoryStore.from_options(
            root, StoreOptions(group_of=group_of, evict_first=is_manifest, verify_blobs=False)
        )
        self.on_read, self.on_write = on_read, on_write
        self.reads: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _read(self, key: str) -> None:
        self.reads.append(key)
        if self.on_read is not None:
            self.on_read(key)

    def _write(self, key: str) -> None:
        if self.on_write is not None:
            self.on_write(key)

    def get_parsed(self, key: str, into: bytearray | None = None, **kw: Any) -> Any:
        """The inner store's, ``verify_crc`` and ``max_bytes`` (the BlobStore Protocol's) passed on."""
        self._read(key)
        return self.inner.get_parsed(key, into=into, **kw)

    def get_parsed_many(self, keys: Sequence[str], **kw: Any) -> list[Any]:
        for key in keys:
            self._read(key)
        return self.inner.get_parsed_many(keys, **kw)

    def put(self, key: str, blob: Any) -> None:
        self._write(key)
        self.inner.put(key, blob)

    def put_many(self, items: Sequence[tuple[str, Any]]) -> None:
        for key, blob in items:
            self.put(key, blob)


def connector(
    root: Path | None, role: KVConnectorRole, parts: ConnectorParts | None = None, **extra: object
) -> KvcodecConnector:
    """A connector over the store at ``root`` (None: no local directory, a ``store`` in ``extra``;
    ``extra``: more ``kv_connector_extra_config`` keys)."""
    ktc = KVTransferConfig(
        kv_connector="KvcodecConnector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "root": None if root is None else str(root),
            "chunk_size": CHUNK,
            "fused": "off",
            **extra,
        },
    )
    hf = SimpleNamespace(to_dict=lambda: {"rope_theta": 1e4}, quantization_config=None)
    mc = SimpleNamespace(model="m", revision=None, dtype=torch.bfloat16, hf_config=hf, quantization=None)
    vcfg = SimpleNamespace(
        kv_transfer_config=ktc,
        model_config=mc,
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    spec = SimpleNamespace(
        num_kv_heads=HEADS, head_size=HEAD, head_size_v=HEAD, dtype=torch.bfloat16, block_size=BLOCK
    )
    kv_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=NAMES)])
    return KvcodecConnector(vcfg, role, kv_config, parts=parts)


def cpu_worker(root: Path | None, parts: ConnectorParts | None = None, **extra: object) -> KvcodecConnector:
    """The worker side with 8 random bf16 blocks per layer registered (the same for every call)."""
    conn = connector(root, KVConnectorRole.WORKER, parts, **extra)
    g = torch.Generator().manual_seed(0)
    conn.register_kv_caches(
        {n: torch.randn(8, HEADS, BLOCK, 2 * HEAD, generator=g).to(torch.bfloat16) for n in NAMES}
    )
    return conn

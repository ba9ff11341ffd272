"""A ``KvcodecConnector`` built as vLLM builds one, without an engine: the worker side with small CPU
caches registered (two layers, two chunks of two blocks), or the scheduler side, for tests that drive
the hooks directly, as vLLM's model runner and scheduler call them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvcodec.integrations.vllm.connector import KvcodecConnector
from kvcodec.integrations.vllm.keys import prefix_hashes

__all__ = ["BLOCK", "BLOCK_IDS", "CHUNK", "HASHES", "HEAD", "LAYERS", "TOKENS", "connector", "cpu_worker"]

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


def connector(root: Path, role: KVConnectorRole, **extra: object) -> KvcodecConnector:
    """A connector over the store at ``root`` (``extra``: more ``kv_connector_extra_config`` keys)."""
    ktc = KVTransferConfig(
        kv_connector="KvcodecConnector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"root": str(root), "chunk_size": CHUNK, "fused": "off", **extra},
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
    return KvcodecConnector(vcfg, role, kv_config)


def cpu_worker(root: Path, **extra: object) -> KvcodecConnector:
    """The worker side with 8 random bf16 blocks per layer registered (the same for every call)."""
    conn = connector(root, KVConnectorRole.WORKER, **extra)
    g = torch.Generator().manual_seed(0)
    conn.register_kv_caches(
        {n: torch.randn(8, HEADS, BLOCK, 2 * HEAD, generator=g).to(torch.bfloat16) for n in NAMES}
    )
    return conn

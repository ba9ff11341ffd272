"""A fused load parses and CRC-checks each blob exactly once, on the loader's side (issue 25).

The connector's load handler (:class:`~kvcodec.integrations.vllm.loads.LoadHandler`, no vLLM needed)
reads a chunk saved by the fused path from a real DirectoryStore and writes it with one launch;
every parse of a blob anywhere in the process is counted (the parser's per-blob steps), and so is
every payload CRC. Tiny shapes; without a GPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.kernels.conftest import DEVICE, KERNEL_MARKS, require_kernels

require_kernels()

import kvcodec.format.parser as parser  # noqa: E402
from kvcodec.integrations.vllm.caches import LayerCaches  # noqa: E402
from kvcodec.integrations.vllm.chunk_keys import ChunkKeys, ChunkRef, group_of  # noqa: E402
from kvcodec.integrations.vllm.chunks import ChunkCodec  # noqa: E402
from kvcodec.integrations.vllm.config import KvcodecConfig  # noqa: E402
from kvcodec.integrations.vllm.counters import Counters  # noqa: E402
from kvcodec.integrations.vllm.fused import FusedLayers  # noqa: E402
from kvcodec.integrations.vllm.identity import CacheGeometry  # noqa: E402
from kvcodec.integrations.vllm.loads import LoadHandler  # noqa: E402
from kvcodec.integrations.vllm.metadata import LoadSpec  # noqa: E402
from kvcodec.store import DirectoryStore, StoreOptions  # noqa: E402

pytestmark = KERNEL_MARKS

H, D, BS, NB, L, CS = 2, 8, 4, 9, 3, 8
TABLE = [7, 2, 5, 0, 3, 8]
HASHES = {"model_id": "tiny", "kv_layout": "vllm-token-major;test"}
CHUNK_HASHES = ["0123456789abcdef" * 2, "fedcba9876543210" * 2]
KEYS = ChunkKeys("00112233aabbccdd")
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


def _caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    phys = (torch.randn(L, NB, BS, H, 2 * D, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    return {n: phys[i].permute(0, 2, 1, 3) for i, n in enumerate(NAMES)}


def _layer_caches(caches: dict[str, torch.Tensor], cc: ChunkCodec) -> LayerCaches:
    layers = {n: i for i, n in enumerate(NAMES)}
    lc = LayerCaches(CacheGeometry(H, D, D, BS, torch.bfloat16, False), layers, CS)
    lc.register(caches, cc)
    lc.fused, why = FusedLayers.build(caches, layers, cc, "on")
    assert lc.fused is not None, why
    return lc


class Count:
    """Counts what the parser does per blob: parses (its per-blob tail step) and payload CRCs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.parses = self.crcs = 0
        trailing, payload_crc = parser._trailing, parser.payload_crc

        def counted_trailing(*args: object) -> object:
            self.parses += 1
            return trailing(*args)

        def counted_crc(*args: object) -> object:
            self.crcs += 1
            return payload_crc(*args)

        monkeypatch.setattr(parser, "_trailing", counted_trailing)
        monkeypatch.setattr(parser, "payload_crc", counted_crc)


def test_a_fused_load_parses_each_blob_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cc = ChunkCodec(head_size=D, block_size=BS, page_size=4, hashes=HASHES)
    src = _layer_caches(_caches(1), cc)
    store = DirectoryStore.from_options(tmp_path, StoreOptions(group_of=group_of, verify_blobs=False))
    for c in (0, 1):
        ref = ChunkRef.of(CHUNK_HASHES, c)
        blobs = src.fused.save(TABLE, c, CS, ref.chunk_hash)  # type: ignore[union-attr]
        store.put_many([(KEYS.blob(0, i, ref), bytes(b)) for i, (_, b) in enumerate(blobs)])
    dst = _layer_caches(_caches(9), cc)
    cfg = KvcodecConfig(root=str(tmp_path), chunk_size=CS)
    counters = Counters()
    loads = LoadHandler(cfg, dst, store, KEYS, counters)
    count = Count(monkeypatch)
    loads.start([LoadSpec("r", 0, 2 * CS, CHUNK_HASHES, TABLE[:4])])  # synchronous: read, check, write
    assert loads.take_errors() == set()
    assert counters.total["chunks_loaded_fused"] == 2
    assert (count.parses, count.crcs) == (2 * L, 2 * L), "each blob parsed and CRC-checked exactly once"
    for n in NAMES:  # the loaded blocks hold the saved K, bit for bit
        assert torch.equal(dst.caches[n][TABLE[:4], ..., :D], src.caches[n][TABLE[:4], ..., :D])

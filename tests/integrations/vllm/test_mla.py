"""MLA latent caches through the connector's per-layer path, no engine: one LATENT blob per layer
and chunk, loaded back bit for bit; a blob of another chunk or layer is refused."""

from __future__ import annotations

import pytest
import torch

from kvcodec import CodecMismatchError, parse
from kvcodec.format import ScaleScheme
from kvcodec.integrations.vllm.chunk_writes import write_chunk
from kvcodec.integrations.vllm.chunks import ChunkCodec, encode_chunk, read_chunk

BLOCK, CHUNK, DIM = 16, 32, 512 + 64
HASHES = {"model_id": "mla", "kv_layout": "vllm-token-major;mla=512+64"}


def _cache(blocks: int = 6, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(blocks, 1, BLOCK, DIM, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_latent_chunk_round_trips_bit_for_bit(dtype: torch.dtype) -> None:
    src, dst = _cache().to(dtype), torch.zeros(6, 1, BLOCK, DIM, dtype=dtype)
    cc = ChunkCodec(head_size=DIM, block_size=BLOCK, model_dtype=dtype, hashes=HASHES)
    blob = encode_chunk(src, [4, 1], cc, start=0, num_tokens=CHUNK, layer_id=2, chunk_id=0, chunk_hash="ab")
    h = parse(blob).header
    assert (h.scale_scheme, h.k_payload_len, h.scale_payload_len) == (ScaleScheme.LATENT, 0, 0)
    assert h.v_payload_len == CHUNK * DIM * 2  # the cache's bytes: 1x, no FP8, no scales
    chunk = read_chunk(
        {"l": blob}, {"l": dst}, {"l": cc}, {"l": 2}, chunk_id=0, num_tokens=CHUNK, chunk_hash="ab"
    )
    write_chunk(chunk, {"l": dst}, [3, 5], start=0)
    assert torch.equal(dst[3].view(torch.int16), src[4].view(torch.int16))
    assert torch.equal(dst[5].view(torch.int16), src[1].view(torch.int16))
    assert not dst[0].any()


def test_a_latent_blob_of_another_chunk_is_refused() -> None:
    cc = ChunkCodec(head_size=DIM, block_size=BLOCK, hashes=HASHES)
    blob = encode_chunk(
        _cache(), [0, 1], cc, start=0, num_tokens=CHUNK, layer_id=0, chunk_id=0, chunk_hash="ab"
    )
    dst = torch.zeros(6, 1, BLOCK, DIM, dtype=torch.bfloat16)
    with pytest.raises(CodecMismatchError):
        read_chunk(
            {"l": blob}, {"l": dst}, {"l": cc}, {"l": 0}, chunk_id=0, num_tokens=CHUNK, chunk_hash="cd"
        )
    assert not dst.any()

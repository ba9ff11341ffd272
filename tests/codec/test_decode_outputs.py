"""decode into the caller's tensors: written in place only when they hold the blob's dtype and shape in
memory of their own; a tensor that would convert K, alias itself, the blob or the other output is refused."""

from __future__ import annotations

import pytest
import torch

from kvcodec import UnsupportedConfigError, decode, encode, parse
from kvcodec.errors import Reason
from tests.raises import raises_reason


def _kv(t: int = 8, h: int = 2, d: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t * h * d)
    return torch.randn(t, h, d, generator=g).half(), torch.randn(t, h, d, generator=g).half()


def test_out_k_of_another_dtype_is_refused_not_converted() -> None:
    k, v = _kv()
    blob = encode(k, v, scope="per_tensor")
    for dt in (torch.int8, torch.bfloat16, torch.float32):
        with raises_reason(UnsupportedConfigError, Reason.BAD_OUTPUT):
            decode(blob, out_k=torch.empty(8, 2, 4, dtype=dt))


@pytest.mark.parametrize("which", ["out_k", "out_v"])
def test_expanded_or_grad_outputs_are_refused(which: str) -> None:
    k, v = _kv()
    blob = encode(k, v, scope="per_tensor")
    dt = torch.float16
    expanded = torch.empty(1, 2, 4, dtype=dt).expand(8, 2, 4)
    with raises_reason(UnsupportedConfigError, Reason.OVERLAP):
        decode(blob, **{which: expanded})
    with raises_reason(UnsupportedConfigError, Reason.BAD_OUTPUT):
        decode(blob, **{which: torch.empty(8, 2, 4, dtype=dt, requires_grad=True)})


def test_out_k_overlapping_the_blob_is_refused() -> None:
    k, v = _kv()
    blob = encode(k, v, scope="per_tensor")
    p = parse(blob)
    k_bytes = memoryview(blob)[p.header_len : p.header_len + p.header.k_payload_len]
    alias = torch.frombuffer(k_bytes, dtype=torch.float16).view(8, 2, 4)
    with raises_reason(UnsupportedConfigError, Reason.OVERLAP):
        decode(blob, out_k=alias)


def test_out_k_and_out_v_sharing_memory_is_refused() -> None:
    k, v = _kv()
    blob = encode(k, v, scope="per_tensor")
    both = torch.empty(8, 2, 4, dtype=torch.float16)
    with raises_reason(UnsupportedConfigError, Reason.OVERLAP):
        decode(blob, out_k=both, out_v=both)
    cache = torch.empty(2, 8, 2, 4, dtype=torch.float16)  # interleaved halves of one buffer are fine
    decode(blob, out_k=cache[0], out_v=cache[1])


def test_out_shapes_must_match_heads_and_dim() -> None:
    k, v = _kv()
    blob = encode(k, v, scope="per_tensor")
    with raises_reason(UnsupportedConfigError, Reason.BAD_SHAPE):
        decode(blob, out_k=torch.empty(8, 4, 2, dtype=torch.float16))
    decode(blob, out_k=torch.empty(4, 2, 2, 4, dtype=torch.float16))  # pages x page_size x H x D is fine


def test_shape_contradicting_the_header_is_refused() -> None:
    k, v = _kv(8, 2, 8)
    blob = encode(k, v, scope="per_layer_head")
    with raises_reason(UnsupportedConfigError, Reason.BAD_SHAPE):
        decode(blob, out_v_dtype=torch.float32, shape=(8, 2 * 2, 4))
    assert decode(blob, shape=(8, 2, 8)).v.shape == (8, 2, 8)


def test_flat_blobs_decode_into_flat_outputs() -> None:
    from kvcodec.format import Header, assemble

    h = Header(k_dtype="float16", v_dtype="float8_e4m3fn", scale_scope=0, scale_shape=())
    blob = assemble(h, bytes(16), bytes(8), torch.tensor([1.0]).numpy().tobytes())
    out = decode(blob)
    assert out.v.shape == (8,)
    decode(blob, out_k=torch.empty(8, dtype=torch.float16), out_v=torch.empty(8, dtype=torch.float32))

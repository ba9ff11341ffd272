"""``encode(..., out=buf)``: written exactly when ``buf`` is memory of its own, refused when it overlaps K, V or scales.

Without the check, payload writes landed on inputs still to be read: over
hundreds of offset pairs many encodes were refused as "V holds NaN", and two
per_tensor ones returned a CRC-valid blob whose V decoded wrong (the amax pass
read V intact, then the K copy overwrote V before the codes were computed).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcodec import UnsupportedConfigError, decode, encode, encoded_size
from kvcodec.errors import Reason
from tests.raises import raises_reason

TOKENS, HEADS, DIM = 16, 2, 32
KV_BYTES = 2 * TOKENS * HEADS * DIM * 2  # K and V, fp16, back to back
SCOPES = ("per_tensor", "per_layer_head", "per_page_head")


def _backends() -> list[str]:
    from kvcodec.backends import cpu

    return ["torch", "cpu"] if cpu.AVAILABLE else ["torch"]


def _kv(seed: int) -> torch.Tensor:
    return torch.randn(2, TOKENS, HEADS, DIM, generator=torch.Generator().manual_seed(seed)).half()


def _blob_size(scope: str) -> int:
    x = torch.zeros(TOKENS, HEADS, DIM).half()
    return encoded_size(x, x, scope=scope, page_size=4)


def _encode_in_shared_buffer(scope: str, backend: str, kv_at: int, out_at: int, seed: int = 0):
    """K and V placed at byte ``kv_at`` of one buffer, the blob written at ``out_at`` of the same buffer.

    Returns (whether the two byte ranges overlap, the blob or the error, the blob of fresh copies).
    """
    n = _blob_size(scope)
    buf = torch.zeros(kv_at + out_at + KV_BYTES + n, dtype=torch.uint8)
    kv = _kv(seed)
    region = buf[kv_at : kv_at + KV_BYTES].view(torch.float16).view(kv.shape)
    region.copy_(kv)
    want = bytes(encode(kv[0].clone(), kv[1].clone(), scope=scope, page_size=4, backend=backend))
    overlapping = out_at < kv_at + KV_BYTES and kv_at < out_at + n
    out = memoryview(buf.numpy())[out_at : out_at + n]
    try:
        got = encode(region[0], region[1], scope=scope, page_size=4, backend=backend, out=out)
    except UnsupportedConfigError as e:
        return overlapping, e, want
    return overlapping, bytes(got), want


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("backend", _backends())
def test_out_overlapping_k_or_v_is_refused_and_disjoint_out_is_exact(scope: str, backend: str) -> None:
    """Over a grid of (K/V offset, out offset) pairs in one buffer: refused with reason OVERLAP exactly
    when the ranges intersect, and otherwise the blob equals the one from fresh copies."""
    n = _blob_size(scope)
    counts = {"refused": 0, "exact": 0}
    for kv_at in range(0, 2 * n, 2 * 151):
        for out_at in range(0, 2 * n, 173):
            overlapping, got, want = _encode_in_shared_buffer(scope, backend, kv_at, out_at)
            if overlapping:
                assert isinstance(got, UnsupportedConfigError), (kv_at, out_at)
                assert got.reason is Reason.OVERLAP
                counts["refused"] += 1
            else:
                assert got == want, (kv_at, out_at)
                counts["exact"] += 1
    assert counts["refused"] > 20 and counts["exact"] > 20  # both sides of the rule were exercised


@pytest.mark.parametrize("backend", _backends())
def test_per_tensor_out_over_v_is_refused_not_written_wrong(backend: str) -> None:
    """The case that used to return a CRC-valid blob with a wrong V: out starts inside K and covers V."""
    kv = _kv(1)
    buf = torch.zeros(KV_BYTES + _blob_size("per_tensor") + 64, dtype=torch.uint8)
    region = buf[:KV_BYTES].view(torch.float16).view(kv.shape)
    region.copy_(kv)
    before = bytes(buf.numpy())
    out = memoryview(buf.numpy())[KV_BYTES // 4 :]
    with raises_reason(UnsupportedConfigError, Reason.OVERLAP):
        encode(region[0], region[1], scope="per_tensor", backend=backend, out=out)
    assert bytes(buf.numpy()) == before  # refused before anything was written


def test_out_overlapping_external_scales_is_refused() -> None:
    kv = _kv(2)
    n = encoded_size(kv[0], kv[1], scope="external", scales=torch.ones(HEADS))
    buf = torch.zeros(n + 64 + (-n) % 4, dtype=torch.uint8)
    scales = buf[-8:].view(torch.float32)
    scales.fill_(0.01)
    with raises_reason(UnsupportedConfigError, Reason.OVERLAP):
        encode(kv[0], kv[1], scope="external", scales=scales, out=memoryview(buf.numpy())[64:])


def test_out_right_after_v_is_not_an_overlap() -> None:
    """Adjacent is not overlapping: out may start at V's last byte + 1."""
    kv = _kv(3)
    buf = torch.zeros(KV_BYTES + _blob_size("per_tensor"), dtype=torch.uint8)
    region = buf[:KV_BYTES].view(torch.float16).view(kv.shape)
    region.copy_(kv)
    blob = encode(region[0], region[1], scope="per_tensor", out=memoryview(buf.numpy())[KV_BYTES:])
    assert torch.equal(decode(bytes(blob)).k, kv[0])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scope=st.sampled_from(SCOPES),
    kv_at=st.integers(0, 4000).map(lambda x: 2 * x),
    out_at=st.integers(0, 8000),
    seed=st.integers(0, 2**16),
)
def test_encode_out_with_overlapping_buffers_property(scope: str, kv_at: int, out_at: int, seed: int) -> None:
    """Any placement of out against K/V in one buffer: refused (OVERLAP) iff the ranges intersect,
    else the same bytes as an encode of fresh copies; never a wrong blob."""
    overlapping, got, want = _encode_in_shared_buffer(
        scope, "cpu" if "cpu" in _backends() else "torch", kv_at, out_at, seed
    )
    if overlapping:
        assert isinstance(got, UnsupportedConfigError) and got.reason is Reason.OVERLAP
    else:
        assert got == want

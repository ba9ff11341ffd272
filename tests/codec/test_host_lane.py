"""The cpu backend's host lane: K, FP8 V and the scales written into a host blob in one C call.

Blobs must be byte-identical to the torch reference's; whatever the lane declines
(strided K, NaN, fp16 scale overflow...) takes the generic path with the same
result or error; and no torch op runs over the payload (an op releases and
retakes the GIL, which costs a caller's thread pool its scaling).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvcodec import CodecError, UnsupportedConfigError, decode, encode
from kvcodec.backends import backend_info, cpu
from kvcodec.errors import Reason
from tests.raises import raises_reason

pytestmark = pytest.mark.skipif(not cpu.AVAILABLE, reason="the C extension is not built")


def _kv(t: int, h: int, d: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, d, generator=g) * 3).to(dtype), (torch.randn(t, h, d, generator=g) * 3).to(
        dtype
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("scope", "page", "shape"),
    [("per_tensor", None, (5, 3, 8)), ("per_layer_head", None, (7, 2, 16)), ("per_page_head", 4, (9, 3, 8))],
)
def test_blobs_equal_the_reference(
    dtype: torch.dtype, scale_dtype: torch.dtype, scope: str, page: int | None, shape: tuple[int, int, int]
) -> None:
    k, v = _kv(*shape, dtype)
    opts = {"scope": scope, "page_size": page, "scale_dtype": scale_dtype, "layer_id": 3, "chunk_id": 1}
    want = bytes(encode(k, v, backend="torch", **opts))
    assert bytes(encode(k, v, backend="cpu", **opts)) == want
    out = bytearray(len(want) + 7)
    view = encode(k, v, backend="cpu", out=out, **opts)
    assert bytes(view) == want


def _fallback_count() -> int:
    return sum(f["count"] for f in backend_info()["fallbacks"])


def test_strided_k_takes_the_generic_path_with_the_same_bytes() -> None:
    k, v = _kv(8, 2, 16, torch.float16)
    k_strided = torch.empty(8, 2, 32, dtype=torch.float16)[:, :, ::2]
    k_strided.copy_(k)
    opts = {"scope": "per_page_head", "page_size": 4}
    assert bytes(encode(k_strided, v, backend="cpu", **opts)) == bytes(encode(k, v, backend="torch", **opts))


@pytest.mark.parametrize("scope", ["per_tensor", "per_page_head"])
def test_nan_in_v_is_refused_as_the_reference_refuses_it(scope: str) -> None:
    k, v = _kv(8, 2, 8, torch.float16)
    v[5, 1, 2] = float("nan")
    errors = []
    for backend in ("cpu", "torch"):
        with pytest.raises(CodecError) as e:
            encode(k, v, scope=scope, page_size=4, backend=backend)
        errors.append((type(e.value), str(e.value)))
    assert errors[0] == errors[1]


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fresh", [True, False])
def test_an_fp16_encode_runs_no_torch_op_and_no_fallback(fresh: bool) -> None:
    """Only ``Tensor.numpy()``'s internal detach shows up; the one GIL release is the C call (and the CRC's)."""
    k, v = _kv(64, 8, 128, torch.float16)
    opts = {"scope": "per_page_head", "page_size": 16, "backend": "cpu"}
    out = bytearray(len(encode(k, v, **opts)))
    before = _fallback_count()
    with _Ops() as mode:
        encode(k, v, **opts) if fresh else encode(k, v, out=out, **opts)
    assert set(mode.ops) <= {"aten.detach.default"}, mode.ops
    assert _fallback_count() == before


@pytest.mark.parametrize("backend", [None, "cpu", "torch"])
@pytest.mark.parametrize("hashes", [None, {"model_id": "m"}], ids=["same-header", "longer-header"])
def test_reencode_into_the_blob_k_was_decoded_from_is_refused(
    backend: str | None, hashes: dict | None
) -> None:
    """decode() hands K back as a view of a writable blob; encoding it into that same blob would write
    the payload over its own input: refused (reason OVERLAP) with the blob untouched, and the same K
    encodes right into memory of its own."""
    k, v = _kv(8, 2, 8, torch.float16, seed=1)
    v_new = _kv(8, 2, 8, torch.float16, seed=2)[1]
    opts = {"scope": "per_page_head", "page_size": 4, "hashes": hashes}
    want = bytes(encode(k, v_new, backend="torch", **opts))
    blob = bytearray(len(want) + 64)
    n = len(encode(k, v, out=blob, backend=backend, scope="per_page_head", page_size=4))
    d = decode(memoryview(blob)[:n], out_v_dtype=torch.float16)
    before = bytes(blob)
    with raises_reason(UnsupportedConfigError, Reason.OVERLAP):
        encode(d.k, v_new, out=blob, backend=backend, **opts)
    assert bytes(blob) == before
    assert bytes(encode(d.k, v_new, backend=backend, **opts)) == want

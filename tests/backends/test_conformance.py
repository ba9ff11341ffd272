"""Every backend against the naive oracle (tests/oracle.py), bit for bit.

One suite, parametrised over backends (``torch``, ``cpu``, ``triton`` under
the CPU interpreter), scopes, dtypes and odd shapes: FP8 codes compared as
bytes and scales with ``torch.equal``. A backend that is not built here fails
its cases in CI (``.ci/run`` requires the C extension) and skips elsewhere
with the reason.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvcodec import backends, decode, encode, parse
from kvcodec.backends import Groups
from kvcodec.format import ScaleScope
from tests.oracle import oracle_dequantize, oracle_encode, oracle_quantize

os.environ.setdefault("KVCODEC_AUTOTUNE", "0")

SCOPES = ["per_tensor", "per_layer_head", "per_page_head"]
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
# (tokens, heads, head_dim, page_size): one token, partial last page, one head,
# head_dim 1/33/256, page 1, a page larger than the chunk.
SHAPES = [
    (1, 1, 8, 4),
    (37, 2, 16, 16),
    (20, 1, 256, 8),
    (12, 3, 48, 1),
    (5, 3, 33, 2),
    (9, 2, 1, 64),
    (64, 8, 128, 16),
]
SMALL = SHAPES[:2]  # the interpreter pays ~10 ms per Triton program


def _backend(name: str) -> backends.Backend:
    if name == "cpu":
        from kvcodec.backends import cpu

        if not cpu.AVAILABLE:
            pytest.skip(f"cpu backend not built: {cpu.REASON}")
    if name == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
            pytest.skip("triton needs CUDA or TRITON_INTERPRET=1 set before it is imported")
    return backends.select(name, "cpu")


def _cases() -> list:
    out = []
    for be in ("torch", "cpu", "triton"):
        marks = [pytest.mark.interpreter] if be == "triton" else []
        for shape in SMALL if be == "triton" else SHAPES:
            for scope in SCOPES:
                out.append(
                    pytest.param(
                        be, shape, scope, id=f"{be}-{scope}-{'x'.join(map(str, shape))}", marks=marks
                    )
                )
    return out


def _v(shape: tuple[int, int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian V with outliers, an all-zero head and values at FP8 rounding ties."""
    t, h, d = shape
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(t, h, d, generator=g) * 3
    v.view(-1)[:: max(1, v.numel() // 7)] *= 40  # outliers
    if h > 1:
        v[:, -1] = 0  # an all-zero group: scale 1.0
    ties = torch.tensor([0.5, 1.5, 2.5, 3.25, 416.0, 432.0, -0.0, 1e-6])
    v.view(-1)[: min(ties.numel(), v.numel())] = ties[: v.numel()]
    return v.to(dtype)


def _q(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


@pytest.mark.parametrize(("name", "shape", "scope"), _cases())
@pytest.mark.parametrize("vdtype", [torch.float16, torch.bfloat16, torch.float32])
def test_encode_v_equals_the_oracle(name: str, shape: tuple, scope: str, vdtype: torch.dtype) -> None:
    be = _backend(name)
    t, h, d, ps = shape
    v = _v((t, h, d), vdtype, seed=t * 31 + d)
    groups = Groups(ScaleScope[scope.upper()], ps if scope == "per_page_head" else None, E4)
    out = torch.empty(t, h, d, dtype=E4)
    scales = be.encode_v(v, groups, scale_dtype=torch.float32, nonfinite="error", out=out)  # no fallback here
    want_s, want_q = oracle_encode(v, scope, ps, E4, torch.float32)
    assert torch.equal(scales, want_s)
    assert torch.equal(_q(out), _q(want_q))


@pytest.mark.parametrize(("name", "shape", "scope"), [c for c in _cases() if c.values[1] in SMALL])
def test_encode_kv_copies_k_and_equals_the_oracle(name: str, shape: tuple, scope: str) -> None:
    be = _backend(name)
    t, h, d, ps = shape
    k, v = torch.randn(t, h, d).bfloat16(), _v((t, h, d), torch.float16, seed=5)
    groups = Groups(ScaleScope[scope.upper()], ps if scope == "per_page_head" else None, E4)
    k_out, out = torch.zeros_like(k), torch.empty(t, h, d, dtype=E4)
    scales = be.encode_kv(k, k_out, v, groups, scale_dtype=torch.float32, nonfinite="error", out=out)
    want_s, want_q = oracle_encode(v, scope, ps, E4, torch.float32)
    assert torch.equal(k_out.view(torch.int16), k.view(torch.int16))
    assert torch.equal(scales, want_s) and torch.equal(_q(out), _q(want_q))


@pytest.mark.parametrize(("name", "shape", "scope"), _cases())
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dequantize_equals_the_oracle(name: str, shape: tuple, scope: str, out_dtype: torch.dtype) -> None:
    be = _backend(name)
    t, h, d, ps = shape
    g = torch.Generator().manual_seed(t + h + d)
    codes = torch.randint(0, 256, (t, h, d), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x10  # no NaN codes: a backend may decline them, the oracle is fine
    q = codes.view(E4)
    ps_ = ps if scope == "per_page_head" else None
    n_s = {"per_tensor": (), "per_layer_head": (h,), "per_page_head": (-(-t // ps), h)}[scope]
    scales = torch.exp2(torch.randint(-20, 20, n_s, generator=g).float()) * (1 + torch.rand(n_s, generator=g))
    out = torch.empty(t, h, d, dtype=out_dtype)
    be.dequantize(q, scales, Groups(ScaleScope[scope.upper()], ps_, E4), out=out)
    assert torch.equal(out, oracle_dequantize(q, scales, scope, ps_, out_dtype))


@pytest.mark.parametrize(("name", "shape", "scope"), _cases())
def test_quantize_with_given_scales_equals_the_oracle(name: str, shape: tuple, scope: str) -> None:
    be = _backend(name)
    t, h, d, ps = shape
    v = _v((t, h, d), torch.float16, seed=7)
    ps_ = ps if scope == "per_page_head" else None
    scales, _ = oracle_encode(v, scope, ps_, E4, torch.float32)
    scales = scales * 0.75  # saturates the largest values
    out = torch.empty(t, h, d, dtype=E4)
    be.quantize(v, scales, Groups(ScaleScope[scope.upper()], ps_, E4), out=out)
    assert torch.equal(_q(out), _q(oracle_quantize(v, scales, scope, ps_, E4)))


@pytest.mark.parametrize("name", ["torch", "cpu"])
@pytest.mark.parametrize("scope", SCOPES)
def test_odd_inputs_equal_the_oracle_through_the_dispatcher(name: str, scope: str) -> None:
    """Strided V, e5m2, fp16 scales: served or declined, the result is the oracle's."""
    be = _backend(name)
    v = _v((24, 3, 40), torch.bfloat16, seed=3).transpose(0, 1).contiguous().transpose(0, 1)  # strided
    for fp8, sdt in ((E4, torch.float16), (E5, torch.float32)):
        groups = Groups(ScaleScope[scope.upper()], 5 if scope == "per_page_head" else None, fp8)
        out = torch.empty(24, 3, 40, dtype=fp8)
        scales = backends.call(be, "encode_v", v, groups, scale_dtype=sdt, nonfinite="error", out=out)
        want_s, want_q = oracle_encode(v, scope, groups.page_size, fp8, sdt)
        assert torch.equal(scales, want_s)
        assert torch.equal(_q(out), _q(want_q))


@pytest.mark.parametrize(("name", "shape", "scope"), [c for c in _cases() if c.values[1] in SMALL])
def test_blobs_through_each_backend_are_identical(name: str, shape: tuple, scope: str) -> None:
    """The codec gives the same bytes on every backend, and decodes them to the oracle's V."""
    _backend(name)
    t, h, d, ps = shape
    k = torch.randn(t, h, d).half()
    v = _v((t, h, d), torch.float16, seed=11)
    blob = encode(k, v, scope=scope, page_size=ps, backend=name)
    assert blob == encode(k, v, scope=scope, page_size=ps, backend="torch")
    p = parse(blob)
    ps_ = ps if scope == "per_page_head" else None
    want_s, want_q = oracle_encode(v, scope, ps_, E4, torch.float32)
    out = decode(blob, out_v_dtype=torch.float32, backend=name)
    assert torch.equal(out.k, k) and torch.equal(out.scales, want_s)
    assert torch.equal(out.v, oracle_dequantize(want_q, want_s, scope, ps_, torch.float32))
    assert bytes(p.v) == want_q.view(torch.uint8).numpy().tobytes()

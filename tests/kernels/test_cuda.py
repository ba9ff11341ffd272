"""GPU-only checks of the Triton kernels: equality with the torch reference on CUDA.

Covers what the interpreter tier cannot: the compiled kernels' rounding on
the device (exhaustive cast, IEEE division with denormals), the hardware FP8
converters of sm_89+ against torch for every fp32 pattern and every FP8
byte, autotuned configs, realistic sizes, and int64 offsets past 2^31
elements. Skipped without a CUDA GPU (tests/kernels/test_triton_*.py also run on CUDA when one is present).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import reference_ops, require_kernels

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)
require_kernels()

from kvcodec.kernels import configs, dequant_triton, fused_triton, operands, quant_triton, vllm_triton  # noqa: E402

from kvcodec.format import ScaleScope  # noqa: E402

pytestmark = pytest.mark.cuda
DEV = "cuda"
Q = reference_ops()
E4 = torch.float8_e4m3fn
E5 = torch.float8_e5m2
PTS = ScaleScope.PER_TENSOR
LH = ScaleScope.PER_LAYER_HEAD
PH = ScaleScope.PER_PAGE_HEAD
SCOPES = [(PTS, None), (LH, None), (PH, 16), (PH, 1), (PH, 7)]


def u8(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1).contiguous().view(torch.uint8).cpu()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(u8(a), u8(b))


def ref_payload(
    k: torch.Tensor, v: torch.Tensor, scope: ScaleScope, ps: int | None, fp8: torch.dtype = E4
) -> torch.Tensor:
    s = Q.compute_scales(v, scope, page_size=ps, fp8_dtype=fp8)
    q = Q.quantize(v, s, scope, page_size=ps, fp8_dtype=fp8)
    return torch.cat([u8(k), u8(q), u8(s)])


@pytest.mark.parametrize("fp8", [E4, E5], ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"]
)
def test_cast_exhaustive_cuda(dtype: torch.dtype, fp8: torch.dtype) -> None:
    """All 16-bit patterns (fp32: patterns widened plus random fp32 bits) vs torch on CUDA and CPU."""
    pats = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    if dtype == torch.float32:
        g = torch.Generator().manual_seed(0)
        x = torch.cat(
            [
                pats.view(torch.float16).float(),
                pats.view(torch.bfloat16).float(),
                torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int32).view(
                    torch.float32
                ),
            ]
        )
    else:
        x = pats.view(dtype)
    xd = x.to(DEV)
    qmax = Q.fp8_max(fp8)
    for s in (
        1.0,
        2.0**-8,
        2.0**8,
        3.0,
        1.0 / 3.0,
        float(torch.finfo(torch.float16).max) / qmax,
        1e-30,
        2.0**-20,
        2.0**-126,
        2.0**-133,
    ):
        st = torch.tensor(s, dtype=torch.float32)
        got = quant_triton.quantize_1d(xd, st, fp8_dtype=fp8)
        ref_gpu = Q.quantize(xd.view(-1, 1, 1), st.to(DEV), PTS, fp8_dtype=fp8)
        assert same(got, ref_gpu), f"scale {s}: differs from torch on CUDA"
        finite = torch.isfinite(x)  # NaN payload/sign handling may differ between torch devices
        ref_cpu = Q.quantize(x.view(-1, 1, 1), st, PTS, fp8_dtype=fp8).view(-1)
        assert torch.equal(got.view(torch.uint8).cpu()[finite], ref_cpu.view(torch.uint8)[finite])


def test_denormal_division_cuda() -> None:
    """bf16 subnormal V: fp32 denormal amax/scale must divide exactly (no flush to zero)."""
    bits = torch.arange(4 * 2 * 64, dtype=torch.int32)
    bits = (bits % 127 + 1) | ((bits % 3 == 0).to(torch.int32) << 15)  # subnormal magnitudes, mixed signs
    v = bits.to(torch.int16).view(torch.bfloat16).view(4, 2, 64)
    assert bool((v.float().abs() < 2.0**-126).all())
    vd = v.to(DEV)
    for scope, ps in SCOPES:
        s = Q.compute_scales(v, scope, page_size=ps)
        assert same(quant_triton.compute_scales(vd, scope, page_size=ps), s)
        assert same(
            quant_triton.quantize(vd, s.to(DEV), scope, page_size=ps), Q.quantize(v, s, scope, page_size=ps)
        )
        k = torch.zeros_like(vd)
        pay = torch.empty(operands.payload_nbytes(k, vd, scope, ps), dtype=torch.uint8, device=DEV)
        fused_triton.encode_fused(k, vd, scope, page_size=ps, payload=pay)
        assert torch.equal(pay.cpu(), ref_payload(k.cpu(), v, scope, ps))


@pytest.mark.parametrize("scope,ps", SCOPES)
@pytest.mark.parametrize("strategy", ["auto", "single", "two_stage"])
def test_encode_decode_cuda_realistic(scope: ScaleScope, ps: int | None, strategy: str) -> None:
    g = torch.Generator().manual_seed(1)
    t, h, d = 300, 8, 128
    k = torch.randn(t, h, d, generator=g).half()
    v = (torch.randn(t, h, d, generator=g) * 5).to(torch.bfloat16)
    kd, vd = k.to(DEV), v.to(DEV)
    want = ref_payload(k, v, scope, ps)
    for off in (0, 1):
        pay = torch.empty(want.numel() + off, dtype=torch.uint8, device=DEV)[off:]
        fused_triton.encode_fused(kd, vd, scope, page_size=ps, payload=pay, strategy=strategy)  # type: ignore[arg-type]
        assert torch.equal(pay.cpu(), want)
        ko, vo = torch.empty_like(kd), torch.empty_like(vd)
        fused_triton.decode_fused(pay, ko, vo, scope, page_size=ps)
        s = Q.compute_scales(v, scope, page_size=ps)
        ref = Q.dequantize(
            Q.quantize(v, s, scope, page_size=ps), s, scope, page_size=ps, out_dtype=torch.bfloat16
        )
        assert torch.equal(ko.cpu(), k) and same(vo, ref)


@pytest.mark.parametrize("d", [48, 96, 128, 256])
def test_head_dims_cuda(d: int) -> None:
    g = torch.Generator().manual_seed(d)
    v = torch.randn(33, 3, d, generator=g).half()
    for scope, ps in SCOPES:
        s = Q.compute_scales(v, scope, page_size=ps)
        vd = v.to(DEV)
        assert same(quant_triton.compute_scales(vd, scope, page_size=ps), s)
        q = quant_triton.quantize(vd, s.to(DEV), scope, page_size=ps)
        assert same(q, Q.quantize(v, s, scope, page_size=ps))
        for od in (torch.float16, torch.bfloat16, torch.float32):
            assert same(
                dequant_triton.dequantize(q, s.to(DEV), scope, page_size=ps, out_dtype=od),
                Q.dequantize(q.cpu(), s, scope, page_size=ps, out_dtype=od),
            )


def test_autotuned_paths_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(configs, "AUTOTUNE", True)
    g = torch.Generator().manual_seed(2)
    n_layers, t, h, d = 4, 256, 8, 128
    ks = torch.randn(n_layers, t, h, d, generator=g).half()
    vs = torch.randn(n_layers, t, h, d, generator=g).half()
    for scope, ps in ((PH, 16), (PTS, None)):  # each (kernel, shape) autotunes: a few compiles each
        nbytes = operands.payload_nbytes(ks[0], vs[0], scope, ps)
        pays = torch.empty((n_layers, nbytes), dtype=torch.uint8, device=DEV)
        fused_triton.encode_fused_layers(ks.to(DEV), vs.to(DEV), scope, page_size=ps, payloads=pays)
        for i in range(n_layers):
            assert torch.equal(pays[i].cpu(), ref_payload(ks[i], vs[i], scope, ps))
        ko = torch.empty((n_layers, t, h, d), dtype=torch.float16, device=DEV)
        vo = torch.empty_like(ko)
        fused_triton.decode_fused_layers(pays, ko, vo, scope, page_size=ps)
        assert torch.equal(ko.cpu(), ks)


def test_nan_inf_cuda() -> None:
    v = torch.randn(16, 2, 64).half()
    v[3, 0, 5] = float("nan")
    v[12, 1, 0] = -float("inf")
    vd = v.to(DEV)
    am = quant_triton.group_amax(vd, PH, page_size=8).cpu()
    assert (
        torch.isnan(am[0, 0])
        and torch.isinf(am[1, 1])
        and torch.isfinite(am[0, 1])
        and torch.isfinite(am[1, 0])
    )
    s = Q.compute_scales(v, PH, page_size=8, nonfinite="saturate")
    assert same(quant_triton.compute_scales(vd, PH, page_size=8, nonfinite="saturate"), s)
    q_ref_gpu = Q.quantize(vd, s.to(DEV), PH, page_size=8)
    assert same(quant_triton.quantize(vd, s.to(DEV), PH, page_size=8), q_ref_gpu)


def _free_gib() -> float:
    free, _ = torch.cuda.mem_get_info()
    return free / 2**30


@pytest.mark.slow
def test_offsets_past_2_31_elements() -> None:
    """Operands that start beyond 2^31 elements of one allocation (int64 addressing)."""
    if _free_gib() < 12:
        pytest.skip("needs ~10 GiB of free GPU memory")
    n = 2**31 + 2**22
    big = torch.empty(n, dtype=torch.float16, device=DEV)
    t, h, d = 64, 8, 128
    g = torch.Generator().manual_seed(4)
    kv = torch.randn(2, t, h, d, generator=g).half()
    start = 2**31 + 1024
    k = big[start : start + t * h * d].view(t, h, d)
    v = big[start + t * h * d : start + 2 * t * h * d].view(t, h, d)
    k.copy_(kv[0])
    v.copy_(kv[1])
    for scope, ps in ((PH, 16), (LH, None), (PTS, None)):
        pay = torch.empty(operands.payload_nbytes(k, v, scope, ps), dtype=torch.uint8, device=DEV)
        fused_triton.encode_fused(k, v, scope, page_size=ps, payload=pay)
        assert torch.equal(pay.cpu(), ref_payload(kv[0], kv[1], scope, ps))
        ko = big[: t * h * d].view(t, h, d)
        vo = big[start + 2 * t * h * d : start + 3 * t * h * d].view(t, h, d)
        fused_triton.decode_fused(pay, ko, vo, scope, page_size=ps)
        assert torch.equal(ko.cpu(), kv[0])
    # A vLLM layer view ([B, H, N, C], C = K | V) of > 2^31 elements: blocks at the end of it.
    bs = 16
    nb = n // (bs * h * 2 * d)
    view = big[: nb * bs * h * 2 * d].view(nb, bs, h, 2 * d).permute(0, 2, 1, 3)
    ids = [nb - 1, 3, nb - 2, nb // 2 + 7]
    src_k, src_v = kv[0][:60], kv[1][:60]
    for i in range(60):
        view[ids[i // bs], :, i % bs, :d] = src_k[i].to(DEV)
        view[ids[i // bs], :, i % bs, d:] = src_v[i].to(DEV)
    pays = operands.empty_payloads(1, operands.payload_nbytes(src_k, src_v, PH, 16), DEV)
    vllm_triton.gather_encode_layers(
        [view], ids, num_tokens=60, head_size=d, scope=PH, page_size=16, payloads=pays
    )
    assert torch.equal(pays[0].cpu(), ref_payload(src_k, src_v, PH, 16))
    del big
    torch.cuda.empty_cache()


def _fp8_paths() -> list[str]:
    """The conversion paths this GPU can run: the integer emulation, and the hardware one on sm_89+."""
    major, minor = torch.cuda.get_device_capability()
    return ["emulated", "hardware"] if (major, minor) >= (8, 9) else ["emulated"]


@pytest.mark.slow
@pytest.mark.parametrize("path", _fp8_paths())
@pytest.mark.parametrize("fp8", [E4, E5], ids=["e4m3fn", "e5m2"])
def test_fp8_conversion_every_fp32_pattern(
    fp8: torch.dtype, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All 2^32 fp32 bit patterns through the kernels' fp32 -> FP8 conversion (scale 1: the division is exact).

    Finite values and ±Inf must equal torch's ``clamp(x, -max, max).to(fp8)`` on
    this GPU byte for byte; NaN must give 0x7F with the input's sign (the
    reference's rule). Run for the integer emulation and, on sm_89+, for the
    hardware ``cvt.rn.satfinite`` path (the PTX semantics the kernels rely on).
    """
    monkeypatch.setenv("KVCODEC_HW_FP8", "1" if path == "hardware" else "0")
    assert operands.hw_fp8(torch.device(DEV)) == (path == "hardware")
    qmax = Q.fp8_max(fp8)
    one = torch.ones((), dtype=torch.float32, device=DEV)
    step = 1 << 28
    for start in range(-(2**31), 2**31, step):
        bits = torch.arange(start, start + step, dtype=torch.int64, device=DEV).to(torch.int32)
        x = bits.view(torch.float32)
        got = quant_triton.quantize_1d(x, one, fp8_dtype=fp8).view(torch.uint8)
        nan = torch.isnan(x)
        ref = x.clamp(-qmax, qmax).to(fp8).view(torch.uint8)
        bad = (got != ref) & ~nan
        assert not bool(bad.any()), (
            f"{int(bad.sum())} differ from {start:#x}; first input bits {int(bits[bad][0]):#x}"
        )
        want_nan = (0x7F | ((bits >> 24) & 0x80)).to(torch.uint8)
        assert torch.equal(got[nan], want_nan[nan])
        del bits, x, got, ref, nan, bad, want_nan


@pytest.mark.parametrize("path", _fp8_paths())
@pytest.mark.parametrize("fp8", [E4, E5], ids=["e4m3fn", "e5m2"])
def test_fp8_decode_every_byte(fp8: torch.dtype, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """All 256 FP8 bytes x assorted scales dequantized (hardware path on sm_89+) equal torch, for every output dtype."""
    monkeypatch.setenv("KVCODEC_HW_FP8", "1" if path == "hardware" else "0")
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).view(256, 1, 1).repeat(1, 2, 16)
    num = ~torch.isnan(q.float())  # NaN payloads may differ; Inf and every number must not
    for s in (1.0, 0.5, 3.0, 1.0 / 3.0, 2.0**-20, 2.0**-133, 7.25e4):
        st = torch.tensor(s, dtype=torch.float32)
        for od in (torch.float16, torch.bfloat16, torch.float32):
            got = dequant_triton.dequantize(q.to(DEV), st.to(DEV), PTS, out_dtype=od)
            ref = Q.dequantize(q.to(DEV), st.to(DEV), PTS, out_dtype=od)
            assert torch.equal(u8(got[num]), u8(ref[num])), (s, od)
            assert bool(torch.isnan(got[~num].float()).all())


def test_hardware_fp8_selected_on_sm89() -> None:
    major, minor = torch.cuda.get_device_capability()
    assert operands.hw_fp8(torch.device(DEV)) == ((major, minor) >= (8, 9))

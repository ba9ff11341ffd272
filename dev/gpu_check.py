"""GPU acceptance check of kvcodec's Triton kernels: CUDA tests, equality checks, bandwidth.

Run from the repository root on a machine with a CUDA GPU and python3, torch
and triton installed (no package registry needed, no install step)::

    PYTHONPATH=. python3 dev/gpu_check.py

It runs, in this order, within about 6 minutes:

1. built-in equality checks of the kernels against the torch reference on
   the GPU (need nothing beyond torch + triton);
2. the pytest GPU tier (tests/kernels/test_cuda.py, tests/kernels/test_triton_quant.py,
   tests/kernels/test_triton_vllm.py (the vLLM connector's fused kernels), tests/integrations/vllm/test_fused.py,
   tests/integrations/vllm/test_fused_async.py (its side-stream save and load), and
   tests/kernels/test_fused_scale_underflow.py, tests/kernels/test_division_proof.py (the
   one-reciprocal division on the hardware), tests/kernels/test_triton_planes.py (the lossless
   payload's K byte planes split and merged on the device), on CUDA tensors) when pytest is
   installed;
3. benchmarks, each against the device-to-device copy of the same bytes
   (``torch.empty_like(x).copy_(x)``) measured in the same run with CUDA
   events (L2 flushed before every timed call):

   * fused encode / decode of a 32-layer x 256-token chunk (8 KV heads x
     128, fp16), all layers in one launch (target >= 85% of copy);
   * the same for one 32k-token layer (target >= 85%);
   * the vLLM connector's gather+encode from a 64k-block layer view with
     shuffled block ids (target >= 70%);
   * the lossless payload's K byte planes split from and merged into the
     32k-token layer's K (no target: measured; the entropy stage is a CPU
     stage, see docs/kernels.md);
   * host CPU time per 32-layer chunk: the launch plus packing 32 headers
     with ``kvcodec.format.HeaderPacker`` (target < 100 us).

4. a ``kvcodec tune`` pass over the llama-3-8b shapes (every config checked
   against the reference, then timed); winners in
   ``bench/results/tuning.json``.

Writes ``bench/results/gpu-check.json`` and prints a table. Without a GPU
it says why and exits 2 without touching the results files.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "gpu-check.json"
TUNING = ROOT / "bench" / "results" / "tuning.json"
TARGETS = {"encode": 0.85, "decode": 0.85, "gather": 0.70}
HOST_TARGET_US = 100.0
TEST_FILES = (
    "tests/kernels/test_cuda.py",
    "tests/kernels/test_triton_quant.py",
    "tests/kernels/test_triton_vllm.py",
    "tests/integrations/vllm/test_fused.py",
    "tests/integrations/vllm/test_fused_async.py",
    "tests/kernels/test_fused_scale_underflow.py",
    "tests/kernels/test_division_proof.py",
    "tests/kernels/test_triton_planes.py",
)


# ----------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------


def ensure_kernels_importable() -> None:
    """Make ``kvcodec`` and ``kvcodec.kernels`` importable from the source tree (no install).

    ``kernels/`` is installed as ``kvcodec.kernels`` by setuptools' package-dir;
    from a bare checkout it is mapped here by hand.
    """
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        import kvcodec.kernels

        return
    except ModuleNotFoundError:
        pass
    import kvcodec

    spec = importlib.util.spec_from_file_location(
        "kvcodec.kernels",
        ROOT / "kernels" / "__init__.py",
        submodule_search_locations=[str(ROOT / "kernels")],
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load kernels from {ROOT / 'kernels'}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kvcodec.kernels"] = mod
    spec.loader.exec_module(mod)
    kvcodec.kernels = mod  # type: ignore[attr-defined]


def gpu_status() -> tuple[bool, str]:
    """(usable, reason): a CUDA GPU visible to torch, and triton importable."""
    try:
        import torch
    except ImportError as e:
        return False, f"torch is not importable ({e})"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU visible (torch.cuda.is_available() is False)"
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    return True, torch.cuda.get_device_name(0)


# ----------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------


class Timer:
    """Median time of a callable: CUDA events with an L2 flush before each call, or perf_counter on CPU."""

    def __init__(self, device: str, *, warmup: int = 3, reps: int = 20, flush_mb: int = 256) -> None:
        import torch

        self.device = device
        self.warmup = warmup
        self.reps = reps
        self._flush = (
            torch.empty(flush_mb << 20, dtype=torch.uint8, device=device)
            if device.startswith("cuda")
            else None
        )

    def ms(self, fn: Callable[[], Any]) -> float:
        import torch

        for _ in range(self.warmup):
            fn()
        times = []
        if self._flush is None:
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        torch.cuda.synchronize()
        for _ in range(self.reps):
            self._flush.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


@dataclass
class Row:
    """One benchmark result against the copy of the same bytes."""

    name: str
    kind: str
    ms: float
    copy_ms: float
    moved_bytes: int
    target: float | None = None
    note: str = ""
    fraction: float = field(init=False)
    gbps: float = field(init=False)

    def __post_init__(self) -> None:
        self.fraction = self.copy_ms / self.ms if self.ms > 0 else 0.0
        self.gbps = self.moved_bytes / (self.ms * 1e6) if self.ms > 0 else 0.0

    @property
    def ok(self) -> bool | None:
        return None if self.target is None else self.fraction >= self.target


def format_table(rows: Sequence[Row], copy_gbps: dict[str, float]) -> str:
    """A fixed-width table of benchmark rows."""
    head = f"{'benchmark':<44} {'ms':>9} {'GB/s':>8} {'vs copy':>8} {'target':>7}  ok"
    lines = [head, "-" * len(head)]
    for r in rows:
        tgt = f"{r.target:.0%}" if r.target is not None else "-"
        ok = "-" if r.ok is None else ("yes" if r.ok else "NO")
        lines.append(f"{r.name:<44} {r.ms:>9.4f} {r.gbps:>8.1f} {r.fraction:>8.1%} {tgt:>7}  {ok}")
    for name, bw in copy_gbps.items():
        lines.append(f"copy bandwidth ({name}): {bw:.1f} GB/s (read + write)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# Built-in equality checks (no pytest needed)
# ----------------------------------------------------------------------------


def fp8_paths(device: str) -> list[str]:
    """FP8 conversion paths the GPU runs: the integer emulation, and the hardware converters on sm_89+."""
    import torch

    if not device.startswith("cuda"):
        return ["emulated"]
    return ["emulated", "hardware"] if torch.cuda.get_device_capability() >= (8, 9) else ["emulated"]


def fp8_exhaustive(device: str, fp8: Any, path: str) -> bool:
    """Every fp32 bit pattern through the kernels' fp32 -> FP8 conversion vs torch's clamp + cast on ``device``.

    NaN must give 0x7F with the input's sign (the reference's rule); all else byte-equal.
    """
    import torch
    from kvcodec.kernels import operands, quant_triton

    prev = os.environ.get("KVCODEC_HW_FP8")
    os.environ["KVCODEC_HW_FP8"] = "1" if path == "hardware" else "0"
    try:
        if operands.hw_fp8(torch.device(device)) != (path == "hardware"):
            raise RuntimeError(f"the {path} FP8 path was not selected")
        qmax = float(torch.finfo(fp8).max)
        one = torch.ones((), dtype=torch.float32, device=device)
        step = 1 << 28
        for start in range(-(2**31), 2**31, step):
            bits = torch.arange(start, start + step, dtype=torch.int64, device=device).to(torch.int32)
            x = bits.view(torch.float32)
            got = quant_triton.quantize_1d(x, one, fp8_dtype=fp8).view(torch.uint8)
            nan = torch.isnan(x)
            ref = x.clamp(-qmax, qmax).to(fp8).view(torch.uint8)
            if bool(((got != ref) & ~nan).any()):
                i = int(((got != ref) & ~nan).nonzero()[0])
                raise AssertionError(
                    f"input bits {int(bits[i]) & 0xFFFFFFFF:#010x}: {int(got[i]):#04x} vs torch {int(ref[i]):#04x}"
                )
            want_nan = (0x7F | ((bits >> 24) & 0x80)).to(torch.uint8)
            if not torch.equal(got[nan], want_nan[nan]):
                raise AssertionError("NaN inputs do not give 0x7F | sign")
        return True
    finally:
        if prev is None:
            os.environ.pop("KVCODEC_HW_FP8", None)
        else:
            os.environ["KVCODEC_HW_FP8"] = prev


def builtin_checks(device: str, *, quick: bool = False) -> list[dict[str, Any]]:
    """Kernel outputs vs the torch reference on ``device``; one dict per check."""
    import torch
    from kvcodec.kernels import fused_triton, operands, quant_triton, vllm_triton

    from kvcodec.backends import reference as Q
    from kvcodec.format import ScaleScope

    out: list[dict[str, Any]] = []

    def check(name: str, fn: Callable[[], bool]) -> None:
        t0 = time.perf_counter()
        try:
            ok, err = bool(fn()), ""
        except Exception as e:  # a failing check is a result, not a crash
            ok, err = False, f"{type(e).__name__}: {e}"
        out.append({"check": name, "ok": ok, "error": err, "s": round(time.perf_counter() - t0, 3)})

    def u8(x: torch.Tensor) -> torch.Tensor:
        return x.detach().reshape(-1).contiguous().view(torch.uint8).cpu()

    def cast_all() -> bool:
        pats = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
        ok = True
        for dt in (torch.float16, torch.bfloat16):
            x = pats.view(dt)
            fin = torch.isfinite(x)
            for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
                for s in (1.0, 3.0, 2.0**-8, 1.0 / 3.0):
                    st = torch.tensor(s)
                    got = u8(quant_triton.quantize_1d(x.to(device), st, fp8_dtype=fp8))
                    ref = u8(Q.quantize(x.view(-1, 1, 1), st, ScaleScope.PER_TENSOR, fp8_dtype=fp8))
                    ok = ok and torch.equal(got[fin], ref[fin])
        return ok

    t, h, d = (13, 2, 48) if quick else (300, 8, 128)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(t, h, d, generator=g).half()
    v = (torch.randn(t, h, d, generator=g) * 5).half()
    scopes = [
        (ScaleScope.PER_TENSOR, None),
        (ScaleScope.PER_LAYER_HEAD, None),
        (ScaleScope.PER_PAGE_HEAD, 16),
        (ScaleScope.PER_PAGE_HEAD, 7),
    ]

    def ref_payload(kk: torch.Tensor, vv: torch.Tensor, scope: ScaleScope, ps: int | None) -> torch.Tensor:
        s = Q.compute_scales(vv, scope, page_size=ps)
        return torch.cat([u8(kk), u8(Q.quantize(vv, s, scope, page_size=ps)), u8(s)])

    def encode_decode(scope: ScaleScope, ps: int | None, strategy: str) -> bool:
        want = ref_payload(k, v, scope, ps)
        pay = torch.empty(want.numel(), dtype=torch.uint8, device=device)
        fused_triton.encode_fused(
            k.to(device), v.to(device), scope, page_size=ps, payload=pay, strategy=strategy
        )  # type: ignore[arg-type]
        ko = torch.empty((t, h, d), dtype=torch.float16, device=device)
        vo = torch.empty_like(ko)
        fused_triton.decode_fused(pay, ko, vo, scope, page_size=ps)
        s = Q.compute_scales(v, scope, page_size=ps)
        ref_v = Q.dequantize(Q.quantize(v, s, scope, page_size=ps), s, scope, page_size=ps)
        return torch.equal(pay.cpu(), want) and torch.equal(ko.cpu(), k) and torch.equal(u8(vo), u8(ref_v))

    def vllm_views(layout: str) -> bool:
        """Fused gather+encode over one vLLM 0.33 layer view ([B, H, N, C], C = K | V) vs gathered rows."""
        nb, bs = (8, 4) if quick else (64, 16)
        cache = torch.randn(nb, bs, h, 2 * d, generator=g).half()
        view = (cache if layout == "NHD" else cache.transpose(1, 2).contiguous().transpose(1, 2)).permute(
            0, 2, 1, 3
        )
        tt = (nb // 2) * bs - 3
        ids = torch.randperm(nb, generator=g)[: -(-tt // bs)].tolist()
        rows = torch.stack([view[ids[t // bs], :, t % bs] for t in range(tt)])
        want = ref_payload(
            rows[..., :d].contiguous(), rows[..., d:].contiguous(), ScaleScope.PER_PAGE_HEAD, 5
        )
        pays = operands.empty_payloads(1, want.numel(), device)
        vllm_triton.gather_encode_layers(
            [view.to(device)],
            ids,
            num_tokens=tt,
            head_size=d,
            scope=ScaleScope.PER_PAGE_HEAD,
            page_size=5,
            payloads=pays,
        )
        return torch.equal(pays[0].cpu(), want)

    if not quick:
        check("cast: all fp16/bf16 patterns, e4m3fn/e5m2, 4 scales", cast_all)
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            for hw in fp8_paths(device):
                check(
                    f"fp8 conversion, all 2^32 fp32 patterns, {str(fp8).removeprefix('torch.')}, {hw}",
                    lambda f=fp8, h=hw: fp8_exhaustive(device, f, h),
                )
    for scope, ps in scopes:
        for strategy in ("single", "two_stage"):
            check(
                f"encode+decode {scope.name.lower()} ps={ps} {strategy}",
                lambda s=scope, p=ps, st=strategy: encode_decode(s, p, st),
            )
    for layout in ("NHD", "HND"):
        check(f"vLLM view gather + fused encode ({layout})", lambda lay=layout: vllm_views(lay))
    for dt in (torch.float16, torch.bfloat16):
        check(
            f"K planes split + merge vs numpy and C ({str(dt).removeprefix('torch.')}, {t + 1}x{h}x{d})",
            lambda dt=dt: k_planes_roundtrip(device, (t + 1, h, d), dt),
        )
    return out


def k_planes_roundtrip(device: str, shape: tuple[int, int, int], dtype: Any) -> bool:
    """The lossless payload's K planes split on ``device`` equal numpy's (and the C loops' where built),
    and merge back to K bit for bit; every 16-bit pattern may occur."""
    import numpy as np
    import torch
    from kvcodec.kernels import planes_triton

    from kvcodec import backends

    t, h, d = shape
    g = torch.Generator().manual_seed(1)
    k = torch.randint(-32768, 32768, shape, generator=g, dtype=torch.int32).to(torch.int16).view(dtype)
    kb = k.view(torch.uint8).numpy().reshape(t, h, d, 2)
    want_hi, want_lo = kb[..., 1].transpose(1, 2, 0).reshape(-1), kb[..., 0].reshape(-1)
    hi, lo = planes_triton.split_k_planes(k.to(device))
    ok = np.array_equal(hi.cpu().numpy(), want_hi) and np.array_equal(lo.cpu().numpy(), want_lo)
    c_hi, c_lo = np.empty(k.numel(), np.uint8), np.empty(k.numel(), np.uint8)
    if backends.k_planes(memoryview(kb).cast("B"), c_hi, c_lo, t, h, d, merge=False):
        ok = ok and np.array_equal(c_hi, want_hi) and np.array_equal(c_lo, want_lo)
    out = torch.empty(shape, dtype=dtype, device=device)
    planes_triton.merge_k_planes(hi, lo, out)
    return ok and torch.equal(out.cpu().view(torch.int16), k.view(torch.int16))


# ----------------------------------------------------------------------------
# Benchmarks
# ----------------------------------------------------------------------------


@dataclass
class Sizes:
    """Benchmark sizes (the defaults are the acceptance workloads)."""

    layers: int = 32
    chunk_tokens: int = 256
    heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    big_tokens: int = 32768
    cache_blocks: int = 65536
    block_size: int = 16
    gather_blocks: int = 4096
    host_iters: int = 200


QUICK_SIZES = Sizes(
    layers=2,
    chunk_tokens=8,
    heads=2,
    head_dim=32,
    page_size=4,
    big_tokens=16,
    cache_blocks=8,
    block_size=4,
    gather_blocks=3,
    host_iters=2,
)
"""Toy sizes for a smoke run of the harness (``--quick``, the unit tests)."""


def _copy_ms(timer: Timer, nbytes: int, device: str) -> float:
    import torch

    x = torch.ones(nbytes // 2, dtype=torch.float16, device=device)
    return timer.ms(lambda: torch.empty_like(x).copy_(x))


def run_benchmarks(
    device: str, sizes: Sizes, timer: Timer, *, budget_s: float = 1e9
) -> tuple[list[Row], dict[str, float], dict[str, Any]]:
    """All benchmark rows, copy bandwidths by workload, and extra facts (skips past ``budget_s``)."""
    import torch
    from kvcodec.kernels import fused_triton, operands, vllm_triton

    from kvcodec.format import ScaleScope

    t_start = time.perf_counter()
    rows: list[Row] = []
    copy_bw: dict[str, float] = {}
    extra: dict[str, Any] = {"skipped": [], "errors": []}
    L, T, H, D, PS = sizes.layers, sizes.chunk_tokens, sizes.heads, sizes.head_dim, sizes.page_size
    PH, LH, PTS = ScaleScope.PER_PAGE_HEAD, ScaleScope.PER_LAYER_HEAD, ScaleScope.PER_TENSOR
    variants = [
        ("per_page_head", PH, PS, "auto"),
        ("per_layer_head", LH, None, "auto"),
        ("per_layer_head single", LH, None, "single"),
        ("per_layer_head two_stage", LH, None, "two_stage"),
        ("per_tensor", PTS, None, "auto"),
    ]

    def measure(
        name: str, kind: str, fn: Callable[[], Any], c_ms: float, moved: int, target: float | None
    ) -> None:
        try:
            ms = timer.ms(fn)
        except Exception as e:  # record it, keep benchmarking the rest
            extra["errors"].append(f"{name}: {type(e).__name__}: {e}"[:2000])
            return
        rows.append(Row(name, kind, ms, c_ms, moved, target))

    def over_budget(what: str) -> bool:
        if time.perf_counter() - t_start > budget_s:
            extra["skipped"].append(what)
            return True
        return False

    # 32-layer chunk, all layers in one launch.
    g = torch.Generator(device=device).manual_seed(0) if device != "cpu" else None
    ks = torch.randn((L, T, H, D), dtype=torch.float16, device=device, generator=g)
    vs = torch.randn((L, T, H, D), dtype=torch.float16, device=device, generator=g)
    in_bytes = 2 * ks.numel() * 2
    c_ms = _copy_ms(timer, in_bytes, device)
    copy_bw[f"{L}-layer chunk"] = 2 * in_bytes / (c_ms * 1e6)
    ko, vo = torch.empty_like(ks), torch.empty_like(vs)
    for label, scope, ps, strat in variants:
        if over_budget(f"chunk {label}"):
            continue
        nb = operands.payload_nbytes(ks[0], vs[0], scope, ps)
        # Rows 16-byte aligned, as the codec allocates them.
        pays = operands.empty_payloads(L, nb, device)
        moved = in_bytes + pays.numel()  # read K+V, write payloads
        measure(
            f"encode {L}x{T} {label}",
            "encode",
            lambda s=scope, p=ps, st=strat, pl=pays: fused_triton.encode_fused_layers(
                ks, vs, s, page_size=p, payloads=pl, strategy=st
            ),  # type: ignore[misc]
            c_ms,
            moved,
            TARGETS["encode"] if strat == "auto" else None,
        )
        if strat == "auto":
            measure(
                f"decode {L}x{T} {label}",
                "decode",
                lambda s=scope, p=ps, pl=pays: fused_triton.decode_fused_layers(pl, ko, vo, s, page_size=p),  # type: ignore[misc]
                c_ms,
                moved,
                TARGETS["decode"],
            )

    # One large layer.
    if not over_budget("large layer"):
        TB = sizes.big_tokens
        k1 = torch.randn((TB, H, D), dtype=torch.float16, device=device, generator=g)
        v1 = torch.randn((TB, H, D), dtype=torch.float16, device=device, generator=g)
        in_bytes = 2 * k1.numel() * 2
        c_ms = _copy_ms(timer, in_bytes, device)
        copy_bw[f"{TB}-token layer"] = 2 * in_bytes / (c_ms * 1e6)
        k1o, v1o = torch.empty_like(k1), torch.empty_like(v1)
        for label, scope, ps, strat in variants:
            if over_budget(f"large {label}"):
                continue
            pay = torch.empty(operands.payload_nbytes(k1, v1, scope, ps), dtype=torch.uint8, device=device)
            moved = in_bytes + pay.numel()
            measure(
                f"encode 1x{TB} {label}",
                "encode",
                lambda s=scope, p=ps, st=strat, pl=pay: fused_triton.encode_fused(
                    k1, v1, s, page_size=p, payload=pl, strategy=st
                ),  # type: ignore[misc]
                c_ms,
                moved,
                TARGETS["encode"] if strat == "auto" else None,
            )
            if strat == "auto":
                measure(
                    f"decode 1x{TB} {label}",
                    "decode",
                    lambda s=scope, p=ps, pl=pay: fused_triton.decode_fused(pl, k1o, v1o, s, page_size=p),  # type: ignore[misc]
                    c_ms,
                    moved,
                    TARGETS["decode"],
                )

    # The lossless payload's K byte planes of the large layer, split and merged on the device.
    if not over_budget("K planes"):
        from kvcodec.kernels import planes_triton

        kp = torch.randn((sizes.big_tokens, H, D), dtype=torch.float16, device=device, generator=g)
        hi, lo = planes_triton.split_k_planes(kp)
        kpo = torch.empty_like(kp)
        c_ms = _copy_ms(timer, kp.numel() * 2, device)
        for what, fn in (
            ("split", lambda: planes_triton.split_k_planes(kp, hi=hi, lo=lo)),
            ("merge", lambda: planes_triton.merge_k_planes(hi, lo, kpo)),
        ):
            measure(f"K planes {what} 1x{sizes.big_tokens}", "planes", fn, c_ms, 2 * kp.numel() * 2, None)

    # vLLM connector's gather+encode from one big layer view, shuffled block ids.
    if not over_budget("vllm gather+encode"):
        NBk, BS, GB = sizes.cache_blocks, sizes.block_size, sizes.gather_blocks
        cache = torch.empty((NBk, BS, H, 2 * D), dtype=torch.float16, device=device).uniform_(-2, 2)
        views = vllm_triton.prepare_views([cache.permute(0, 2, 1, 3)], D)
        ids = torch.randperm(NBk, device="cpu")[:GB].to(device)
        tok = GB * BS
        in_bytes = 2 * tok * H * D * 2
        c_ms = _copy_ms(timer, in_bytes, device)
        copy_bw[f"gather {tok} tokens"] = 2 * in_bytes / (c_ms * 1e6)
        k0 = torch.empty((tok, H, D), dtype=torch.float16, device="meta")
        pays = operands.empty_payloads(1, operands.payload_nbytes(k0, k0, PH, PS), device)
        measure(
            f"vllm gather+encode {GB} of {NBk} blocks per_page_head",
            "gather",
            lambda: vllm_triton.gather_encode_layers(
                views, ids, num_tokens=tok, head_size=D, scope=PH, page_size=PS, payloads=pays
            ),
            c_ms,
            in_bytes + pays.numel(),
            TARGETS["gather"],
        )

    try:
        extra["host"] = host_overhead(device, sizes)
    except Exception as e:
        extra["errors"].append(f"host overhead: {type(e).__name__}: {e}"[:2000])
        extra["host"] = {
            "ok": False,
            "error": str(e)[:500],
            "layers": L,
            "launch_us": None,
            "headers_us": None,
            "headers_with_replace_us": None,
            "total_us": None,
        }
    extra["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    return rows, copy_bw, extra


def autotuned_headline(device: str, sizes: Sizes, timer: Timer) -> list[Row]:
    """The 32-layer chunk encode/decode again with autotuned tiles (rows named "... autotuned")."""
    import torch
    from kvcodec.kernels import fused_triton, operands

    from kvcodec.format import ScaleScope

    L, T, H, D, PS = sizes.layers, sizes.chunk_tokens, sizes.heads, sizes.head_dim, sizes.page_size
    ks = torch.randn((L, T, H, D), dtype=torch.float16, device=device)
    vs = torch.randn((L, T, H, D), dtype=torch.float16, device=device)
    ko, vo = torch.empty_like(ks), torch.empty_like(vs)
    in_bytes = 2 * ks.numel() * 2
    c_ms = _copy_ms(timer, in_bytes, device)
    rows = []
    for label, scope, ps in (
        ("per_page_head", ScaleScope.PER_PAGE_HEAD, PS),
        ("per_layer_head", ScaleScope.PER_LAYER_HEAD, None),
    ):
        pays = operands.empty_payloads(L, operands.payload_nbytes(ks[0], vs[0], scope, ps), device)
        moved = in_bytes + pays.numel()
        ms = timer.ms(
            lambda s=scope, p=ps, pl=pays: fused_triton.encode_fused_layers(
                ks, vs, s, page_size=p, payloads=pl
            )
        )  # type: ignore[misc]
        rows.append(Row(f"encode {L}x{T} {label} autotuned", "encode", ms, c_ms, moved, TARGETS["encode"]))
        ms = timer.ms(
            lambda s=scope, p=ps, pl=pays: fused_triton.decode_fused_layers(pl, ko, vo, s, page_size=p)
        )  # type: ignore[misc]
        rows.append(Row(f"decode {L}x{T} {label} autotuned", "decode", ms, c_ms, moved, TARGETS["decode"]))
    return rows


def tune_pass(device: str, out: Path, reps: int = 20) -> dict[str, Any]:
    """``kvcodec tune`` on the llama-3-8b shapes: winners written to ``out``; a summary (never raises)."""
    import torch

    t0 = time.perf_counter()
    try:
        import triton
        from kvcodec.kernels import configs

        from kvcodec.tools import tune as T

        results = T.tune(T.PRESETS["llama-3-8b"], device, reps=reps)
        print(T.format_results(results, dry_run=False), flush=True)
        table = configs.TuningTable.load(out)
        gpu = torch.cuda.get_device_name()
        for r in results:
            if r.best_us is not None:
                bt, nw = r.best.split("x/")
                table.put(
                    gpu,
                    triton.__version__,
                    r.kernel,
                    r.key,
                    configs.TileConfig(int(bt), int(nw.rstrip("w"))),
                    us=round(r.best_us, 2),
                    default_us=round(r.default_us or 0.0, 2),
                )
        table.save(out)
        return {
            "ok": not any(r.failed for r in results),
            "file": str(out),
            "s": round(time.perf_counter() - t0, 1),
            "results": [asdict(r) for r in results],
        }
    except Exception as e:
        return {
            "ok": False,
            "error": f"{type(e).__name__}: {e}"[:2000],
            "s": round(time.perf_counter() - t0, 1),
        }


def host_overhead(device: str, sizes: Sizes) -> dict[str, Any]:
    """Host CPU time per 32-layer chunk: one fused launch plus 32 packed headers (no device sync inside)."""
    import torch
    from kvcodec.kernels import fused_triton, operands

    from kvcodec.format import Hashes, Header, HeaderPacker, ScaleScope, header_size, pack_header_into

    L, T, H, D, PS = sizes.layers, sizes.chunk_tokens, sizes.heads, sizes.head_dim, sizes.page_size
    ks = torch.zeros((L, T, H, D), dtype=torch.float16, device=device)
    vs = torch.zeros_like(ks)
    scope = ScaleScope.PER_PAGE_HEAD
    nb = operands.payload_nbytes(ks[0], vs[0], scope, PS)
    pays = operands.empty_payloads(L, nb, device)
    n_el = T * H * D
    template = Header(
        k_dtype=torch.float16,
        v_dtype=torch.float8_e4m3fn,
        scale_dtype=torch.float32,
        scale_scope=scope,
        layer_id=0,
        chunk_id=0,
        chunk_size=T,
        page_size=PS,
        kv_head_count=H,
        head_dim=D,
        scale_shape=(-(-T // PS), H),
        k_payload_len=2 * n_el,
        v_payload_len=n_el,
        scale_payload_len=nb - 3 * n_el,
        hashes=Hashes(model_id="m", kv_layout="flash_nhd"),
    )
    hs = header_size(template)
    hbuf = bytearray(hs * L)
    views = [memoryview(hbuf)[i * hs : (i + 1) * hs] for i in range(L)]
    iters = sizes.host_iters

    headers = [template.replace(layer_id=i) for i in range(L)]
    packer = HeaderPacker(template)

    def launch() -> None:
        fused_triton.encode_fused_layers(ks, vs, scope, page_size=PS, payloads=pays)

    def pack() -> None:
        # What the connector path does: one template, ids and CRC patched per layer.
        for i in range(L):
            packer.pack_into(views[i], layer_id=i, chunk_id=0, crc=0)

    def pack_full() -> None:
        for i in range(L):
            pack_header_into(views[i], headers[i], 0)

    def replace_and_pack() -> None:
        for i in range(L):
            pack_header_into(views[i], template.replace(layer_id=i), 0)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def per_iter_us(fn: Callable[[], None]) -> float:
        fn()  # warm (compiles)
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t1 = time.perf_counter()
        sync()
        return (t1 - t0) / iters * 1e6

    launch_us = per_iter_us(launch)
    pack_us = per_iter_us(pack)
    pack_full_us = per_iter_us(pack_full)
    replace_us = per_iter_us(replace_and_pack)

    def both() -> None:
        launch()
        pack()

    total_us = per_iter_us(both)
    return {
        "launch_us": round(launch_us, 1),
        "headers_us": round(pack_us, 1),
        "headers_full_serialize_us": round(pack_full_us, 1),
        "headers_with_replace_us": round(replace_us, 1),
        "total_us": round(total_us, 1),
        "target_us": HOST_TARGET_US,
        "ok": total_us < HOST_TARGET_US,
        "layers": L,
        "note": "total = one fused launch for all layers + L headers from one HeaderPacker template "
        "(CRC computed elsewhere, from the payload)",
    }


# ----------------------------------------------------------------------------
# pytest tier (in a child process, with a timeout)
# ----------------------------------------------------------------------------


def run_pytest_child(files: Sequence[str], summary_path: str) -> int:
    """Child-process body: run pytest on ``files`` and write pass/fail counts to ``summary_path``."""
    ensure_kernels_importable()
    os.environ.setdefault("KVCODEC_AUTOTUNE", "0")
    import pytest

    counts: dict[str, int] = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    failures: list[str] = []

    class Collector:
        def pytest_runtest_logreport(self, report: Any) -> None:
            if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
                key = report.outcome if report.outcome in counts else "error"
                if report.when == "setup" and report.outcome == "failed":
                    key = "error"
                counts[key] += 1
                if report.outcome == "failed":
                    failures.append(report.nodeid)

    args = [
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "--rootdir",
        str(ROOT),
        *[str(ROOT / f) for f in files],
    ]
    rc = int(pytest.main(args, plugins=[Collector()]))
    Path(summary_path).write_text(json.dumps({"rc": rc, **counts, "failures": failures[:50]}))
    return rc


def run_pytest(files: Sequence[str], timeout_s: float) -> dict[str, Any]:
    """Run the pytest tier in a child process; counts, rc and output tail."""
    if importlib.util.find_spec("pytest") is None:
        return {"ran": False, "reason": "pytest is not installed (built-in checks cover the kernels)"}
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "pytest.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--pytest-child", str(summary), *files]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
            tail = (proc.stdout + proc.stderr)[-3000:]
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"") if isinstance(e.stdout, bytes) else (e.stdout or "").encode()
            tail = out.decode(errors="replace")[-3000:]
            rc = None
        res: dict[str, Any] = {
            "ran": True,
            "rc": rc,
            "timed_out": rc is None,
            "s": round(time.perf_counter() - t0, 1),
        }
        if summary.is_file():
            res.update(json.loads(summary.read_text()))
        res["tail"] = tail
        return res


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def summarize(
    *,
    device_name: str,
    checks: list[dict[str, Any]],
    tests: dict[str, Any],
    rows: Sequence[Row],
    copy_bw: dict[str, float],
    extra: dict[str, Any],
    elapsed_s: float,
) -> dict[str, Any]:
    """The JSON summary (``ok``: every check, test and targeted benchmark passed)."""
    import torch

    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    host = extra.get("host", {})
    # A workload meets its target if its heuristic or its autotuned row does.
    best: dict[str, bool] = {}
    for r in rows:
        if r.ok is not None:
            key = r.name.removesuffix(" autotuned")
            best[key] = best.get(key, False) or bool(r.ok)
    bench_ok = all(best.values()) and host.get("ok", True)
    tests_ok = (not tests.get("ran")) or (tests.get("rc") == 0)
    return {
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton_v,
        "python": platform.python_version(),
        "checks": checks,
        "checks_ok": all(c["ok"] for c in checks),
        "tests": tests,
        "tests_ok": tests_ok,
        "copy_GBps": {k: round(v, 1) for k, v in copy_bw.items()},
        "bench": [{**asdict(r), "ok": r.ok} for r in rows],
        "host": host,
        "skipped": extra.get("skipped", []),
        "tune": extra.get("tune"),
        "tune_ok": (extra.get("tune") or {"ok": True})["ok"],
        "errors": extra.get("errors", []),
        "bench_ok": bench_ok and not extra.get("errors"),
        "ok": all(c["ok"] for c in checks) and tests_ok and bench_ok and not extra.get("errors"),
        "elapsed_s": round(elapsed_s, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (0 also when there is no GPU to check)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS, help="JSON summary path")
    ap.add_argument("--skip-tests", action="store_true", help="skip the pytest tier")
    ap.add_argument("--test-timeout", type=float, default=180.0, help="seconds for the pytest tier")
    ap.add_argument(
        "--budget", type=float, default=320.0, help="seconds after which optional parts are skipped"
    )
    ap.add_argument(
        "--autotune",
        action="store_true",
        help="autotune every benchmark (slow: one compile per config and shape)",
    )
    ap.add_argument(
        "--device", default="cuda", help="device (cpu only as a smoke run under TRITON_INTERPRET=1)"
    )
    ap.add_argument("--quick", action="store_true", help="toy sizes (a smoke run of the harness)")
    ap.add_argument("--skip-tune", action="store_true", help="skip the kvcodec tune pass")
    ap.add_argument("--tuning-out", type=Path, default=TUNING, help="tuning file the tune pass writes")
    ap.add_argument("--pytest-child", metavar="SUMMARY", help=argparse.SUPPRESS)
    ap.add_argument("files", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.pytest_child:
        return run_pytest_child(args.files or TEST_FILES, args.pytest_child)

    ok, why = gpu_status() if args.device != "cpu" else (True, "cpu (smoke run)")
    if not ok:
        print(
            f"gpu_check: cannot run: {why}. Nothing was checked. Run it on a machine with an NVIDIA GPU:",
            file=sys.stderr,
        )
        print("    PYTHONPATH=. python3 dev/gpu_check.py", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    ensure_kernels_importable()
    import torch

    device = args.device
    print(f"gpu_check on {why} (torch {torch.__version__})", flush=True)
    checks = builtin_checks(device, quick=args.quick)
    for c in checks:
        print(f"  check {'ok ' if c['ok'] else 'FAIL'} {c['check']} {c['error']}", flush=True)
    tests: dict[str, Any] = {"ran": False, "reason": "--skip-tests"}
    if not args.skip_tests:
        tests = run_pytest(
            TEST_FILES, min(args.test_timeout, max(60.0, args.budget - 120 - (time.perf_counter() - t0)))
        )
        if tests.get("ran"):
            print(
                f"  pytest: rc={tests.get('rc')} passed={tests.get('passed')} failed={tests.get('failed')} "
                f"skipped={tests.get('skipped')} ({tests.get('s')} s)",
                flush=True,
            )
            if tests.get("rc") != 0:
                print(tests.get("tail", ""))
        else:
            print(f"  pytest: not run ({tests.get('reason')})")
    timer = Timer(device, warmup=0, reps=1, flush_mb=1) if args.quick else Timer(device)
    sizes = QUICK_SIZES if args.quick else Sizes()
    from kvcodec.kernels import configs

    configs.AUTOTUNE = bool(args.autotune)  # heuristic tiles; the headline rows get an autotuned pass below
    remaining = args.budget - (time.perf_counter() - t0)
    rows, copy_bw, extra = run_benchmarks(device, sizes, timer, budget_s=max(remaining, 30.0))
    remaining = args.budget - (time.perf_counter() - t0)
    if not args.autotune and device != "cpu":
        if remaining > 60:
            configs.AUTOTUNE = True
            try:
                rows += autotuned_headline(device, sizes, timer)
            except Exception as e:
                extra["errors"].append(f"autotuned pass: {type(e).__name__}: {e}"[:2000])
            configs.AUTOTUNE = False
        else:
            extra["skipped"].append("autotuned headline rows (time budget)")
    if not args.skip_tune and device != "cpu":
        remaining = args.budget - (time.perf_counter() - t0)
        if remaining > 90:
            extra["tune"] = tune_pass(device, args.tuning_out)
        else:
            extra["skipped"].append("kvcodec tune pass (time budget)")
    print(format_table(rows, copy_bw))
    for err in extra["errors"]:
        print(f"  ERROR {err}")
    host = extra["host"]
    print(
        f"host CPU per {host['layers']}-layer chunk: launch {host['launch_us']} us + {host['layers']} headers "
        f"{host['headers_us']} us (with Header.replace: {host['headers_with_replace_us']} us) = "
        f"{host['total_us']} us (target < {HOST_TARGET_US:.0f} us: {'yes' if host['ok'] else 'NO'})"
    )
    summary = summarize(
        device_name=why,
        checks=checks,
        tests=tests,
        rows=rows,
        copy_bw=copy_bw,
        extra=extra,
        elapsed_s=time.perf_counter() - t0,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out} (overall ok: {summary['ok']}, {summary['elapsed_s']} s)")
    return 0 if summary["checks_ok"] and summary["tests_ok"] and summary["tune_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

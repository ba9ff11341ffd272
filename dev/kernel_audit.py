"""Kernel audit: compile the launches the codec makes for NVIDIA GPUs ahead of time, check them against a budget.

No GPU needed. For a fixed set of workloads (the headline chunk: 32 layers x
256 tokens x 8 KV heads x 128 head_dim, fp16; encode and decode per scope;
stacked and separately allocated layers; the vLLM connector's fused
gather+encode and decode+scatter over vLLM 0.33 layer views) the launchers run inside
:func:`kvcodec.kernels.launch.recording`, which plans them for a simulated
CUDA GPU and records them instead of launching. Each recorded launch is
specialised exactly as Triton's JIT would on CUDA (Triton's own binder: ints
equal to 1 become constexprs, multiples of 16 and 16-byte aligned pointers get
divisibility hints), compiled with ``triton.compile`` for sm_90 (sm_80 and
sm_100 too with ``--all``), and its cubin read with the ``cuobjdump`` bundled
with Triton. Per compile it reports registers, spills and local memory,
shared memory, the widths of global loads and stores, SASS instructions per
tile element, and, for FP8 conversions, whether they are one hardware
rounding with no fp16 intermediate.

Rules always enforced: every compile succeeds; no spills or local memory; a
kernel planned with hardware FP8 converts shows the single ``cvt`` and no
fp16 step; workloads marked vectorisable issue 128-bit loads and stores.
Against the budget (``bench/kernel_budget.json``, one section per Triton
minor version) nothing may regress: registers, SASS instructions per
element, narrow (< 32-bit) accesses, 128-bit accesses, shared memory.

    python dev/kernel_audit.py            # sm_90, heuristic configs (about a minute); make kernel-audit
    python dev/kernel_audit.py --all      # sm_80, sm_90, sm_100 and every config of the tuning space
    python dev/kernel_audit.py --update   # write this run's numbers as the budget

A developer tool, not part of the installed package: it runs from the source
tree against the installed ``kvcodec`` (``make install``).

Exit status: 0 clean, 1 a rule broken or a regression, 2 cannot run here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_BUDGET",
    "CompileJob",
    "Record",
    "Violation",
    "analyze",
    "check",
    "collect_jobs",
    "format_table",
    "main",
    "parse_sass",
    "update_budget",
]

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUDGET = ROOT / "bench" / "kernel_budget.json"
BUDGET_FORMAT = "kvcodec-kernel-budget/1"
SASS_SLACK = 1.02
"""SASS instructions per element may grow 2% before it counts as a regression (scheduling noise)."""

HEADLINE = {"layers": 32, "tokens": 256, "heads": 8, "dim": 128, "page_size": 16}


# ----------------------------------------------------------------------------
# Workloads: what the codec launches
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """A named call into the launchers; ``vec``: its hot accesses can be 128-bit."""

    name: str
    run: Callable[[], None]
    vec: bool = True


def _listed_views(n: int, shape: tuple[int, ...], dtype: Any) -> list[Any]:
    """``n`` separately allocated tensors: 512-byte aligned like CUDA's allocator, unevenly spaced.

    Uneven spacing makes the launchers address layers through an offset table,
    as they must for vLLM's per-layer caches.
    """
    import math

    import torch

    numel = math.prod(shape)
    es = torch.empty((), dtype=dtype).element_size()
    align = 512 // es
    offs, pos = [], 0
    for i in range(n):
        offs.append(pos)
        pos += -(-(numel + (i % 3 + 1) * align) // align) * align
    buf = torch.empty(pos + align, dtype=dtype)
    shift = (-buf.data_ptr() // es) % align
    return [buf[shift + o : shift + o + numel].view(shape) for o in offs]


def headline_workloads(quick: bool = False) -> list[Workload]:
    """The audited workloads (``quick``: a handful, for tests)."""
    import torch
    from kvcodec.kernels import dequant_triton, fused_triton, operands, quant_triton

    from kvcodec.format import ScaleScope
    from kvcodec.numerics import amax_to_scale, fp8_max

    L, T, H, D, PS = (HEADLINE[k] for k in ("layers", "tokens", "heads", "dim", "page_size"))
    f16 = torch.float16
    scopes = [
        ("per_page_head", ScaleScope.PER_PAGE_HEAD, PS),
        ("per_layer_head", ScaleScope.PER_LAYER_HEAD, None),
        ("per_tensor", ScaleScope.PER_TENSOR, None),
    ]
    if quick:
        scopes = scopes[:1]
    out: list[Workload] = []

    def nbytes(scope: ScaleScope, ps: int | None) -> int:
        return operands.payload_nbytes(
            torch.empty(T, H, D, dtype=f16), torch.empty(T, H, D, dtype=f16), scope, ps
        )

    for label, scope, ps in scopes:

        def enc_stacked(scope: ScaleScope = scope, ps: int | None = ps) -> None:
            ks, vs = torch.empty(L, T, H, D, dtype=f16), torch.empty(L, T, H, D, dtype=f16)
            fused_triton.encode_fused_layers(
                ks, vs, scope, page_size=ps, payloads=operands.empty_payloads(L, nbytes(scope, ps), "cpu")
            )

        def enc_listed(scope: ScaleScope = scope, ps: int | None = ps) -> None:
            ks, vs = _listed_views(L, (T, H, D), f16), _listed_views(L, (T, H, D), f16)
            pays = _listed_views(L, (nbytes(scope, ps),), torch.uint8)
            fused_triton.encode_fused_layers(ks, vs, scope, page_size=ps, payloads=pays)

        def dec_stacked(scope: ScaleScope = scope, ps: int | None = ps) -> None:
            ko, vo = torch.empty(L, T, H, D, dtype=f16), torch.empty(L, T, H, D, dtype=f16)
            fused_triton.decode_fused_layers(
                operands.empty_payloads(L, nbytes(scope, ps), "cpu"), ko, vo, scope, page_size=ps
            )

        def dec_listed(scope: ScaleScope = scope, ps: int | None = ps) -> None:
            ko, vo = _listed_views(L, (T, H, D), f16), _listed_views(L, (T, H, D), f16)
            fused_triton.decode_fused_layers(
                _listed_views(L, (nbytes(scope, ps),), torch.uint8), ko, vo, scope, page_size=ps
            )

        def enc_one(scope: ScaleScope = scope, ps: int | None = ps) -> None:
            k, v = torch.empty(T, H, D, dtype=f16), torch.empty(T, H, D, dtype=f16)
            fused_triton.encode_fused(
                k, v, scope, page_size=ps, payload=torch.empty(nbytes(scope, ps), dtype=torch.uint8)
            )

        out += [
            Workload(f"encode {L}L stacked {label}", enc_stacked),
            Workload(f"encode {L}L listed {label}", enc_listed),
            Workload(f"decode {L}L stacked {label}", dec_stacked),
            Workload(f"decode {L}L listed {label}", dec_listed),
            Workload(f"encode 1L {label}", enc_one),
        ]
    if quick:
        return out

    def unfused() -> None:
        v = torch.empty(T, H, D, dtype=f16)
        s = amax_to_scale(
            quant_triton.group_amax(v, ScaleScope.PER_PAGE_HEAD, page_size=PS), fp8_max(torch.float8_e4m3fn)
        )
        q = quant_triton.quantize(v, s, ScaleScope.PER_PAGE_HEAD, page_size=PS)
        dequant_triton.dequantize(q, s, ScaleScope.PER_PAGE_HEAD, page_size=PS, out_dtype=f16)

    out.append(Workload("unfused amax+quantize+dequantize per_page_head", unfused))
    return out + vllm_workloads() + planes_workloads()


VLLM_LAYOUTS = ("LBNHC", "LBHNC", "BLHNC", "BLNHC", "BHLNC", "LHBNC")
"""vLLM 0.33's KVCacheLayout physical orders (L layer, B block, N slot, H head, C channel)."""


def _vllm_views(layout: str, layers: int, blocks: int, heads: int, bs: int, c: int, dtype: Any) -> list[Any]:
    """Per-layer ``[B, H, N, C]`` views of one 512-byte aligned allocation in ``layout``'s order (as vLLM makes them)."""

    size = {"L": layers, "B": blocks, "N": bs, "H": heads, "C": c}
    phys = _listed_views(1, tuple(size[a] for a in layout), dtype)[0]
    rest = layout.replace("L", "")
    return [phys.select(layout.index("L"), i).permute([rest.index(a) for a in "BHNC"]) for i in range(layers)]


def vllm_workloads() -> list[Workload]:
    """The vLLM connector's fused gather+encode / decode+scatter over vLLM 0.33 layer views (headline chunk)."""
    import torch
    from kvcodec.kernels import operands, vllm_triton

    from kvcodec.format import ScaleScope

    L, T, H, D, PS = (HEADLINE[k] for k in ("layers", "tokens", "heads", "dim", "page_size"))
    f16, bs, nb = torch.float16, 16, 32
    ids = [(7 * i + 3) % nb for i in range(T // bs)]
    PH, LH, PT = ScaleScope.PER_PAGE_HEAD, ScaleScope.PER_LAYER_HEAD, ScaleScope.PER_TENSOR

    def pays(scope: ScaleScope, ps: int | None) -> Any:
        x = torch.empty(T, H, D, dtype=f16)
        return operands.empty_payloads(L, operands.payload_nbytes(x, x, scope, ps), "cpu")

    def listed() -> list[Any]:  # separately allocated layers: an offset table
        return [
            c.view(nb, bs, H, 2 * D).permute(0, 2, 1, 3)
            for c in _listed_views(L, (nb * bs * H * 2 * D,), f16)
        ]

    def enc(layout: str, scope: ScaleScope, ps: int | None, sep: bool = False) -> Callable[[], None]:
        def run() -> None:
            views = listed() if sep else _vllm_views(layout, L, nb, H, bs, 2 * D, f16)
            vllm_triton.gather_encode_layers(
                views, ids, num_tokens=T, head_size=D, scope=scope, page_size=ps, payloads=pays(scope, ps)
            )

        return run

    def dec(layout: str, scope: ScaleScope, ps: int | None) -> Callable[[], None]:
        def run() -> None:
            views = _vllm_views(layout, L, nb, H, bs, 2 * D, f16)
            vllm_triton.decode_scatter_layers(
                pays(scope, ps), views, ids, num_tokens=T, head_size=D, scope=scope, page_size=ps
            )

        return run

    out = [Workload(f"vllm encode {L}L {lay} per_page_head", enc(lay, PH, PS)) for lay in VLLM_LAYOUTS]
    out += [
        Workload(f"vllm encode {L}L listed per_page_head", enc("LBNHC", PH, PS, sep=True)),
        Workload(f"vllm encode {L}L LBNHC per_layer_head", enc("LBNHC", LH, None)),
        Workload(f"vllm encode {L}L LBNHC per_tensor", enc("LBNHC", PT, None)),
    ]
    out += [Workload(f"vllm decode {L}L {lay} per_page_head", dec(lay, PH, PS)) for lay in ("LBNHC", "LHBNC")]
    out.append(Workload(f"vllm decode {L}L LBNHC per_tensor", dec("LBNHC", PT, None)))
    return out


def planes_workloads() -> list[Workload]:
    """The lossless payload's K byte planes split and merged on the device (one headline layer; and a
    token count that is not a multiple of 16, whose transposed plane cannot take 128-bit accesses)."""
    import torch
    from kvcodec.kernels import planes_triton

    T, H, D = (HEADLINE[k] for k in ("tokens", "heads", "dim"))

    def split(t: int) -> Callable[[], None]:
        return lambda: planes_triton.split_k_planes(torch.empty(t, H, D, dtype=torch.float16))

    def merge(t: int) -> Callable[[], None]:
        def run() -> None:
            n = t * H * D
            hi, lo = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
            planes_triton.merge_k_planes(hi, lo, torch.empty(t, H, D, dtype=torch.bfloat16))

        return run

    odd = T - 6
    return [
        Workload(f"planes split 1L {T} tokens", split(T)),
        Workload(f"planes merge 1L {T} tokens", merge(T)),
        Workload(f"planes split 1L {odd} tokens", split(odd), vec=False),
        Workload(f"planes merge 1L {odd} tokens", merge(odd), vec=False),
    ]


# ----------------------------------------------------------------------------
# From recorded launches to compile jobs (Triton's own CUDA specialisation)
# ----------------------------------------------------------------------------


@dataclass
class CompileJob:
    """One kernel specialisation to compile for one architecture."""

    workload: str
    kernel: str
    arch: int
    config: str
    elems_per_thread: float
    hw_fp8: bool
    encodes_fp8: bool
    vec: bool
    spec: dict[str, Any] = field(repr=False)
    """kwargs to specialise on: launch arguments plus num_warps (picklable summary only)."""

    def key(self) -> str:
        return f"{self.workload} | {self.kernel} | sm_{self.arch} | {self.config}"


def _jit_of(kernel: Any) -> tuple[Any, dict[str, Callable[[dict[str, Any]], Any]]]:
    """The JITFunction under autotune/heuristics wrappers, and the heuristics to apply."""
    from triton.runtime.jit import JITFunction

    heur: dict[str, Callable[[dict[str, Any]], Any]] = {}
    k = kernel
    while not isinstance(k, JITFunction):
        heur.update(getattr(k, "values", {}) or {})
        k = k.fn
    return k, heur


class _FakePtr:
    """A picklable stand-in for a tensor argument: Triton specialises on dtype and alignment only."""

    def __init__(self, dtype: Any, ptr: int) -> None:
        self.dtype = dtype
        self._ptr = ptr

    def data_ptr(self) -> int:
        return self._ptr


def _summarise_args(kw: dict[str, Any]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    for k, v in kw.items():
        if isinstance(v, torch.Tensor):
            out[k] = ("tensor", str(v.dtype).removeprefix("torch."), v.data_ptr() % 256)
        else:
            out[k] = v
    return out


def collect_jobs(workloads: Sequence[Workload], archs: Sequence[int], all_configs: bool) -> list[CompileJob]:
    """Record every workload's launches and turn each (launch, arch, config) into a compile job."""
    from kvcodec.kernels import configs
    from kvcodec.kernels.launch import H200, Target, recording

    jobs: list[CompileJob] = []
    seen: set[str] = set()
    for arch in archs:
        target = Target(False, H200.sm_count, (arch // 10, arch % 10), f"simulated sm_{arch}")
        for w in workloads:
            with recording(target) as launches:
                w.run()
            for ln in launches:
                jit, heur = _jit_of(ln.kernel)
                name = jit.fn.__name__
                kw = dict(ln.kwargs)
                block_d = int(kw.get("BLOCK_D", 1))
                cfgs = [
                    configs.TileConfig(
                        int(kw.get("BLOCK_T", kw.get("BLOCK", 1))), int(kw.get("num_warps", 4))
                    )
                ]
                if all_configs and "BLOCK_T" in kw:
                    cfgs = configs.config_space(configs.rows_covered(kw), block_d, name)
                for cfg in cfgs:
                    spec = dict(kw)
                    if "BLOCK_T" in spec:
                        spec["BLOCK_T"] = cfg.block_t
                    spec["num_warps"] = cfg.num_warps
                    for hname, fn in heur.items():
                        spec[hname] = fn(spec)
                    tile = cfg.block_t * block_d if "BLOCK_T" in spec else int(spec.get("BLOCK", 1))
                    job = CompileJob(
                        workload=w.name,
                        kernel=name,
                        arch=arch,
                        config=f"{cfg.block_t}x{block_d}/{cfg.num_warps}w",
                        elems_per_thread=tile / (32 * cfg.num_warps),
                        hw_fp8=bool(spec.get("HW_FP8", False)),
                        encodes_fp8="MAX_BITS" in spec,
                        vec=w.vec,
                        spec=_summarise_args(spec),
                    )
                    if job.key() not in seen:
                        seen.add(job.key())
                        jobs.append(job)
    return jobs


def _specialise(jit: Any, spec: dict[str, Any], arch: int) -> tuple[Any, Any, dict[str, Any]]:
    """(ASTSource, GPUTarget, options) exactly as Triton's JIT builds them for a CUDA launch."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kw: dict[str, Any] = {}
    for k, v in spec.items():
        if isinstance(v, tuple) and v and v[0] == "tensor":
            kw[k] = _FakePtr(getattr(torch, v[1]), 0x7F0000000000 + int(v[2]))
        else:
            kw[k] = v
    kw["enable_fp_fusion"] = False
    try:
        from triton.runtime.jit import create_function_from_signature

        binder = create_function_from_signature(jit.signature, jit.params, backend)
        bound, specialization, opts = binder(**kw)
        options, signature, constexprs, attrs = jit._pack_args(backend, opts, bound, specialization, opts)
        return ASTSource(jit, signature, constexprs, attrs), target, options.__dict__
    except (ImportError, AttributeError, TypeError):
        return _specialise_fallback(jit, kw, backend, target)


_TRITON_TYPES = {
    "float16": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "uint8": "u8",
    "int8": "i8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
}


def _specialise_fallback(
    jit: Any, kw: dict[str, Any], backend: Any, target: Any
) -> tuple[Any, Any, dict[str, Any]]:
    """Triton's documented CUDA specialisation, for versions whose binder differs."""
    from triton.compiler import ASTSource

    opt_names = set(backend.parse_options({}).__dict__)
    sig: dict[str, str] = {}
    consts: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, p in enumerate(jit.params):
        v = kw[p.name]
        div16 = False
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, _FakePtr):
            sig[p.name] = "*" + _TRITON_TYPES[str(v.dtype).removeprefix("torch.")]
            div16 = v.data_ptr() % 16 == 0
        elif isinstance(v, bool):
            sig[p.name] = "u1"
        elif isinstance(v, int):
            if v == 1:
                sig[p.name], consts[p.name] = "constexpr", 1
            else:
                sig[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
                div16 = v % 16 == 0
        else:
            sig[p.name] = "fp32"
        if div16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = backend.parse_options({k: v for k, v in kw.items() if k in opt_names}).__dict__
    return ASTSource(jit, sig, consts, attrs), target, options


# ----------------------------------------------------------------------------
# Compile and read the cubin
# ----------------------------------------------------------------------------


@dataclass
class Record:
    """What the audit measured for one compile job."""

    key: str
    workload: str
    kernel: str
    arch: int
    config: str
    ok: bool
    error: str = ""
    regs: int = 0
    local_bytes: int = 0
    spill_insts: int = 0
    shared: int = 0
    sass: int = 0
    sass_per_elem: float = 0.0
    ld128: int = 0
    st128: int = 0
    ld_narrow: int = 0
    st_narrow: int = 0
    ldg: dict[str, int] = field(default_factory=dict)
    stg: dict[str, int] = field(default_factory=dict)
    hw_fp8: bool = False
    encodes_fp8: bool = False
    fp8_cvt: str = ""
    f16_step: bool = False
    vec: bool = True
    seconds: float = 0.0


def cuobjdump_path() -> str | None:
    """The cuobjdump shipped with Triton (or on PATH)."""
    try:
        import triton

        p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if p.is_file():
            return str(p)
    except ImportError:
        pass
    return shutil.which("cuobjdump")


_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")
_WIDTH = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128, "256": 256}


def _width(op: str) -> int:
    for part in reversed(op.split(".")[1:]):
        if part in _WIDTH:
            return _WIDTH[part]
    return 32


def parse_sass(text: str) -> dict[str, Any]:
    """Counts from ``cuobjdump -sass``: instructions (no NOPs), global load/store widths, local accesses."""
    ops = [m.group(1) for m in _OPCODE.finditer(text)]
    ops = [o for o in ops if not o.startswith("NOP")]
    ldg: dict[str, int] = {}
    stg: dict[str, int] = {}
    for o in ops:
        base = o.split(".")[0]
        if base in ("LDG", "STG"):
            d = ldg if base == "LDG" else stg
            w = str(_width(o))
            d[w] = d.get(w, 0) + 1
    return {
        "sass": len(ops),
        "ldg": ldg,
        "stg": stg,
        "spill_insts": sum(1 for o in ops if o.split(".")[0] in ("LDL", "STL")),
    }


_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def parse_res_usage(text: str) -> dict[str, int]:
    """Registers, stack, static shared and local memory from ``cuobjdump -res-usage``."""
    m = _RES.search(text)
    if not m:
        return {"regs": 0, "stack": 0, "shared_static": 0, "local": 0}
    r, st, sh, lo = (int(x) for x in m.groups())
    return {"regs": r, "stack": st, "shared_static": sh, "local": lo}


def fp8_convert_facts(ptx: str) -> tuple[str, bool]:
    """(the hardware fp32->FP8 cvt found, whether an fp32->fp16 rounding step is present)."""
    hw = re.findall(r"cvt\.rn\.satfinite\.e[45]m[23]x2\.f32", ptx)
    f16 = bool(re.search(r"cvt\.r[nz]\.f16(x2)?\.f32|cvt\.rn\.satfinite\.e[45]m[23]x2\.f16x2", ptx))
    return (hw[0] if hw else ""), f16


def analyze(job: CompileJob, ptx: str, sass: str, res: str, shared: int, seconds: float) -> Record:
    """One :class:`Record` from a compile's PTX, SASS and resource usage."""
    s = parse_sass(sass)
    r = parse_res_usage(res)
    cvt, f16 = fp8_convert_facts(ptx) if job.encodes_fp8 else ("", False)
    narrow = lambda d: sum(n for w, n in d.items() if int(w) < 32)  # noqa: E731
    wide = lambda d: sum(n for w, n in d.items() if int(w) >= 128)  # noqa: E731
    return Record(
        key=job.key(),
        workload=job.workload,
        kernel=job.kernel,
        arch=job.arch,
        config=job.config,
        ok=True,
        regs=r["regs"],
        local_bytes=r["local"] + r["stack"],
        spill_insts=s["spill_insts"],
        shared=shared,
        sass=s["sass"],
        sass_per_elem=round(s["sass"] / max(job.elems_per_thread, 1e-9), 2),
        ld128=wide(s["ldg"]),
        st128=wide(s["stg"]),
        ld_narrow=narrow(s["ldg"]),
        st_narrow=narrow(s["stg"]),
        ldg=s["ldg"],
        stg=s["stg"],
        hw_fp8=job.hw_fp8,
        encodes_fp8=job.encodes_fp8,
        fp8_cvt=cvt,
        f16_step=f16,
        vec=job.vec,
        seconds=round(seconds, 2),
    )


def compile_job(job: CompileJob) -> Record:
    """Compile one job and measure it (never raises: a failed compile is a record)."""
    import triton
    from kvcodec.kernels import planes_triton, vllm_triton  # noqa: F401  (imports and registers every kernel)
    from kvcodec.kernels.tiles import JIT_KERNELS

    t0 = time.perf_counter()
    try:
        raw = JIT_KERNELS[job.kernel]
        jit, _ = _jit_of(raw)
        src, target, options = _specialise(jit, job.spec, job.arch)
        ck = triton.compile(src, target=target, options=options)
        tool = cuobjdump_path()
        if tool is None:
            raise RuntimeError("cuobjdump not found (it ships with triton under backends/nvidia/bin)")
        with tempfile.TemporaryDirectory() as tmp:
            cub = Path(tmp) / "k.cubin"
            cub.write_bytes(ck.asm["cubin"])
            sass = subprocess.run(
                [tool, "-sass", str(cub)], capture_output=True, text=True, check=True
            ).stdout
            res = subprocess.run(
                [tool, "-res-usage", str(cub)], capture_output=True, text=True, check=True
            ).stdout
        return analyze(
            job, ck.asm["ptx"], sass, res, int(getattr(ck.metadata, "shared", 0)), time.perf_counter() - t0
        )
    except Exception as e:  # recorded, reported as a broken rule
        msg = f"{type(e).__name__}: {e}".strip().splitlines()
        return Record(
            key=job.key(),
            workload=job.workload,
            kernel=job.kernel,
            arch=job.arch,
            config=job.config,
            ok=False,
            error=" ".join(msg)[-400:],
            hw_fp8=job.hw_fp8,
            encodes_fp8=job.encodes_fp8,
            vec=job.vec,
            seconds=round(time.perf_counter() - t0, 2),
        )


def run_jobs(jobs: Sequence[CompileJob], workers: int, progress: bool = True) -> list[Record]:
    """Compile every job (``workers`` processes; 1 = in this process)."""
    out: list[Record] = []

    def note(i: int, r: Record) -> None:
        if progress:
            print(f"\r  compiled {i}/{len(jobs)}", end="", file=sys.stderr, flush=True)

    if workers <= 1:
        for i, j in enumerate(jobs, 1):
            out.append(compile_job(j))
            note(i, out[-1])
    else:
        with ProcessPoolExecutor(max_workers=workers) as ex:
            for i, r in enumerate(ex.map(compile_job, jobs), 1):
                out.append(r)
                note(i, r)
    if progress and jobs:
        print(file=sys.stderr)
    return out


# ----------------------------------------------------------------------------
# Rules and budget
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Violation:
    """One broken rule or regression."""

    key: str
    what: str


METRICS_MAX = ("regs", "sass_per_elem", "ld_narrow", "st_narrow", "shared")
METRICS_MIN = ("ld128", "st128")


def rule_violations(r: Record) -> list[Violation]:
    """The rules every compile must satisfy, budget or not."""
    v: list[Violation] = []
    if not r.ok:
        return [Violation(r.key, f"compile failed: {r.error}")]
    if r.spill_insts or r.local_bytes:
        v.append(
            Violation(r.key, f"spills: {r.spill_insts} local-memory instructions, {r.local_bytes} bytes")
        )
    if r.hw_fp8 and r.encodes_fp8:
        if not r.fp8_cvt:
            v.append(Violation(r.key, "HW_FP8 planned but no cvt.rn.satfinite.*.f32 in the PTX"))
        if r.f16_step:
            v.append(Violation(r.key, "FP8 conversion rounds through fp16 (double rounding)"))
    stores = sum(r.stg.values())
    if r.vec and (r.ld128 == 0 or (stores and r.st128 == 0)):
        v.append(
            Violation(r.key, f"hot path not vectorised: {r.ld128} 128-bit loads, {r.st128} 128-bit stores")
        )
    return v


def budget_section(budget: dict[str, Any], version: str) -> dict[str, Any] | None:
    """The budget's entries for a Triton version (by major.minor)."""
    mm = ".".join(version.split(".")[:2])
    sec = budget.get("triton", {}).get(mm)
    return sec.get("records") if isinstance(sec, dict) else None


def check(records: Iterable[Record], budget: dict[str, Any] | None) -> list[Violation]:
    """Rule violations plus regressions against ``budget`` (``{key: {metric: limit}}``, or None)."""
    out: list[Violation] = []
    for r in records:
        out += rule_violations(r)
        if not r.ok or budget is None:
            continue
        b = budget.get(r.key)
        if b is None:
            continue
        for m in METRICS_MAX:
            if m in b:
                lim = b[m] * (SASS_SLACK if m == "sass_per_elem" else 1)
                if getattr(r, m) > lim:
                    out.append(Violation(r.key, f"{m} {getattr(r, m)} > budget {b[m]}"))
        for m in METRICS_MIN:
            if m in b and getattr(r, m) < b[m]:
                out.append(Violation(r.key, f"{m} {getattr(r, m)} < budget {b[m]}"))
    return out


def update_budget(budget: dict[str, Any], records: Iterable[Record], version: str) -> dict[str, Any]:
    """``budget`` with this Triton version's section replaced by ``records``' numbers (compiled ones)."""
    mm = ".".join(version.split(".")[:2])
    recs = {r.key: {m: getattr(r, m) for m in METRICS_MAX + METRICS_MIN} for r in records if r.ok}
    out = {"format": BUDGET_FORMAT, "triton": dict(budget.get("triton", {}))}
    out["triton"][mm] = {"version": version, "records": dict(sorted(recs.items()))}
    return out


def load_budget(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {"format": BUDGET_FORMAT, "triton": {}}
    obj = json.loads(path.read_text())
    if obj.get("format") != BUDGET_FORMAT:
        raise ValueError(f"{path}: not a kernel budget file (format {obj.get('format')!r})")
    return obj


# ----------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------


def _short(kernel: str) -> str:
    return kernel.strip("_").removesuffix("_kernel")


def format_table(records: Sequence[Record], violations: Sequence[Violation]) -> str:
    """A fixed-width table, one row per compile (``!`` marks a row with a violation)."""
    bad = {v.key for v in violations}
    head = (
        f"{'workload':<44} {'kernel':<13} {'sm':>3} {'config':<12} {'regs':>4} {'spill':>5} {'smem':>6} "
        f"{'ld128/<32':>9} {'st128/<32':>9} {'sass/el':>7} {'fp8 cvt':<9}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        mark = "!" if r.key in bad else " "
        if not r.ok:
            lines.append(
                f"{mark}{r.workload:<43} {_short(r.kernel):<13} {r.arch:>3} {r.config:<12} COMPILE FAILED"
            )
            continue
        cvt = (
            "-"
            if not r.encodes_fp8
            else ("hw" + ("+f16!" if r.f16_step else "") if r.fp8_cvt else "int-emul")
        )
        lines.append(
            f"{mark}{r.workload:<43} {_short(r.kernel):<13} {r.arch:>3} {r.config:<12} {r.regs:>4} "
            f"{r.spill_insts:>5} {r.shared:>6} {f'{r.ld128}/{r.ld_narrow}':>9} {f'{r.st128}/{r.st_narrow}':>9} "
            f"{r.sass_per_elem:>7.1f} {cvt:<9}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def _can_run() -> str | None:
    """Why the audit cannot run here (None when it can)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    from kvcodec.kernels.launch import INTERPRET

    if INTERPRET:
        return "TRITON_INTERPRET is set: the audit compiles real kernels; unset it"
    if cuobjdump_path() is None:
        return "cuobjdump not found (it ships with triton's NVIDIA backend)"
    return None


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="python dev/kernel_audit.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--all", action="store_true", help="sm_80, sm_90 and sm_100, every config of the tuning space"
    )
    p.add_argument(
        "--arch", type=int, action="append", help="compute capability x10 (repeatable; default 90)"
    )
    p.add_argument(
        "--configs", action="store_true", help="every config of the tuning space, not only the heuristic"
    )
    p.add_argument("--budget", type=Path, default=DEFAULT_BUDGET, help="budget file (default %(default)s)")
    p.add_argument(
        "--update", action="store_true", help="write this run's numbers as the budget for this Triton"
    )
    p.add_argument("--rules-only", action="store_true", help="check the rules, not the budget")
    p.add_argument("--json", type=Path, help="write every record here")
    p.add_argument("--quick", action="store_true", help="a few workloads only (tests)")
    p.add_argument(
        "-j", "--jobs", type=int, default=None, help="compile processes (default 1; --all: all CPUs)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    why = _can_run()
    if why:
        print(f"kernel audit: cannot run: {why}", file=sys.stderr)
        return 2
    import triton

    archs = args.arch or ([80, 90, 100] if args.all else [90])
    all_cfg = args.all or args.configs
    workers = args.jobs if args.jobs is not None else ((os.cpu_count() or 1) if args.all else 1)
    t0 = time.perf_counter()
    jobs = collect_jobs(headline_workloads(quick=args.quick), archs, all_cfg)
    print(
        f"kernel audit: triton {triton.__version__}, {len(jobs)} compiles for sm_{'/sm_'.join(map(str, archs))}",
        file=sys.stderr,
    )
    records = run_jobs(jobs, workers)
    try:
        budget_all = load_budget(args.budget)
    except (OSError, ValueError) as e:
        print(f"kernel audit: {e}", file=sys.stderr)
        return 2
    section = None if args.rules_only else budget_section(budget_all, triton.__version__)
    violations = check(records, section)
    print(format_table(records, violations))
    for v in violations:
        print(f"  VIOLATION {v.key}: {v.what}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "triton": triton.__version__,
                    "records": [asdict(r) for r in records],
                    "violations": [asdict(v) for v in violations],
                },
                indent=1,
            )
        )
    missing = [r.key for r in records if r.ok and section is not None and r.key not in section]
    if section is None and not args.rules_only:
        print(f"no budget for triton {triton.__version__} in {args.budget}: rules only (--update writes one)")
    elif missing:
        print(f"{len(missing)} compiles have no budget entry (checked by the rules only; --update adds them)")
    if args.update:
        if any(not r.ok for r in records):
            print("not updating the budget: some compiles failed")
            return 1
        args.budget.parent.mkdir(parents=True, exist_ok=True)
        args.budget.write_text(
            json.dumps(update_budget(budget_all, records, triton.__version__), indent=1) + "\n"
        )
        print(f"wrote the budget for triton {triton.__version__} to {args.budget}")
    n_bad = len({v.key for v in violations})
    print(f"kernel audit: {len(records)} compiles, {n_bad} with violations, {time.perf_counter() - t0:.0f} s")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())

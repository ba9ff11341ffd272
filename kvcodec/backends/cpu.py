"""The "native" backend: the codec's CPU loops in C (``kvcodec._cpu``), bit-exact with :mod:`kvcodec.quant`.

torch's fp32 -> e4m3 cast and its FP8 widening are scalar loops on CPU; the C
loops do the same arithmetic (IEEE division, round to nearest even, the same
saturation) in a few vectorised integer operations, over two threads for large
chunks, with the GIL released. The module has :mod:`kvcodec.quant`'s
``compute_scales`` / ``quantize`` / ``dequantize`` signatures and hands any
case it does not cover to that reference: non-CPU tensors, e5m2, a head_dim
that is not contiguous, ``nonfinite="saturate"``, non-finite or non-positive
scales, NaN in V or NaN codes in q. The extension is optional (built at
install when a C compiler is present): :data:`AVAILABLE` says whether it is.
"""

from __future__ import annotations

import math
import operator
import os
import re

import torch

from . import quant
from .crc import crc32
from .errors import UnsupportedConfigError
from .format import ScaleScope

__all__ = [
    "AVAILABLE",
    "OPENMP",
    "can_encode_fused",
    "compute_scales",
    "copy_crc",
    "crc_threads",
    "dequantize",
    "empty_bytearray",
    "encode_chunk",
    "quantize",
    "threads",
    "token_head_amax",
]

try:
    from . import _cpu  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the install
    _cpu = None

AVAILABLE: bool = _cpu is not None
"""Whether the C extension is built and importable."""


_SO = re.compile(r"\.so(\.\d+)*$")


def _loaded_openmp() -> str:
    """Path of the OpenMP runtime loaded into this process (Linux), or "".

    Read off ``/proc/self/maps``; with several loaded, the one in torch's own
    directory wins, then libgomp, libiomp5, libomp.
    """
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "omp" in line}
    except OSError:
        return ""
    torch_dir = os.path.dirname(torch.__file__)
    prefixes = ("libgomp", "libiomp5", "libomp")
    found = [
        (not p.startswith(torch_dir), i, p)
        for p in paths
        if _SO.search(p)
        for i, pre in enumerate(prefixes)
        if os.path.basename(p).startswith(pre)
    ]
    return min(found)[2] if found else ""


OPENMP: bool = bool(
    _cpu is not None
    and os.environ.get("KVCODEC_OPENMP", "1") != "0"
    and torch.backends.openmp.is_available()
    and _cpu.use_openmp(_loaded_openmp())
)
"""Whether a fused encode's two threads are a team of torch's own OpenMP runtime
(no contention with its spinning workers) rather than a thread of kvcodec's.
``KVCODEC_OPENMP=0`` turns it off."""


LAST_ENCODE_THREADS = 0
"""Threads the latest :func:`encode_chunk` ran on (for tests and benchmarks)."""

_LONG = 1 << 20
"""Bytes from which a CRC may be split over two threads (the C side's threshold too)."""

_DTYPE_CODE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
_SCOPE_CODE = {ScaleScope.PER_TENSOR: 0, ScaleScope.PER_LAYER_HEAD: 1, ScaleScope.PER_PAGE_HEAD: 2}


def threads() -> int:
    """Threads kvcodec's C code may use: ``KVCODEC_THREADS`` (default 2, at most torch's intra-op count).

    A fused chunk encode splits its work (K's copy and CRC beside V's codes),
    and so do the CRC and copy+CRC of buffers from 1 MiB when torch's OpenMP
    runtime is at hand (:data:`OPENMP`). quantize/dequantize alone run on one
    thread: memory-bound here, and a second thread met torch's spinning workers.
    """
    try:
        n = int(os.environ.get("KVCODEC_THREADS", "2"))
    except ValueError:
        n = 2
    return max(1, min(n, torch.get_num_threads()))


def crc_threads() -> int:
    """Threads for a CRC of a long buffer (>= 1 MiB): :func:`threads` on torch's
    own OpenMP team, else one (a thread of kvcodec's met torch's spinning workers)."""
    return threads() if OPENMP else 1


if _cpu is not None:
    from . import crc as _crc

    _crc.set_threads_source(crc_threads)


def _rows_ok(x: torch.Tensor, dtypes: object) -> bool:
    """A CPU ``[T, H, D]`` tensor of a handled dtype, head_dim contiguous, elements aligned.

    Alignment matters: C may assume a ``uint16_t *`` is 2-byte aligned, and a
    tensor over a buffer at an odd offset (a view into a blob) is not.
    """
    return (
        _cpu is not None
        and x.device.type == "cpu"
        and x.dim() == 3
        and x.dtype in dtypes  # type: ignore[operator]
        and (x.shape[2] <= 1 or x.stride(2) == 1)
        and x.numel() > 0
        and x.data_ptr() % x.element_size() == 0
        and not x.is_neg()  # lazy negation/conjugation: C would read the raw bytes
        and not x.is_conj()
    )


def _out_ok(x: torch.Tensor, dtypes: object) -> bool:
    """An output the C loops may write: as :func:`_rows_ok`, and no two elements sharing memory."""
    return _rows_ok(x, dtypes) and torch._debug_has_internal_overlap(x) == 0


def _page(scope: ScaleScope, page_size: int | None) -> int | None:
    """The page size C gets (1 outside per_page_head), or None when it is not a positive int."""
    if scope != ScaleScope.PER_PAGE_HEAD:
        return 1
    try:
        ps = operator.index(page_size)  # type: ignore[arg-type]
    except TypeError:
        return None
    return ps if ps >= 1 else None


def token_head_amax(v: torch.Tensor, *, finite_only: bool = False) -> torch.Tensor:
    """``amax(|V|)`` over head_dim per (token, head), fp32 ``[tokens, heads]`` (see :mod:`kvcodec.quant`)."""
    if finite_only or not _rows_ok(v, _DTYPE_CODE):
        return quant.token_head_amax(v, finite_only=finite_only)
    t, h, d = v.shape
    out = torch.empty((t, h), dtype=torch.float32)
    _cpu.token_head_amax(v.data_ptr(), t, h, d, v.stride(0), v.stride(1), _DTYPE_CODE[v.dtype],
                         out.data_ptr(), 1)  # fmt: skip
    return out


def compute_scales(
    v: torch.Tensor,
    scope: ScaleScope,
    *,
    page_size: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    nonfinite: quant.NonFinitePolicy = "error",
) -> torch.Tensor:
    """fp32 scales of ``v`` for a scope; equal to :func:`kvcodec.quant.compute_scales`."""
    if (
        nonfinite != "error"
        or fp8_dtype != torch.float8_e4m3fn
        or scope not in _SCOPE_CODE
        or _page(scope, page_size) is None
        or not _rows_ok(v, _DTYPE_CODE)
    ):
        return quant.compute_scales(v, scope, page_size=page_size, fp8_dtype=fp8_dtype, nonfinite=nonfinite)
    amax = quant.reduce_groups(token_head_amax(v), scope, page_size)
    quant.check_finite_amax(amax, scope)
    return quant.amax_to_scale(amax, quant.fp8_max(fp8_dtype))


def _scales_f32(scales: torch.Tensor) -> torch.Tensor | None:
    """Scales as contiguous fp32 on CPU, or None when some are not finite and positive."""
    s = _aligned_f32(scales)
    return s if bool(((s > 0) & torch.isfinite(s)).all()) else None


def _aligned_f32(scales: torch.Tensor) -> torch.Tensor:
    """Scales as contiguous, 4-byte aligned fp32 on CPU (what the C loops index)."""
    s = scales.to(device="cpu", dtype=torch.float32).contiguous()
    return s.clone() if s.data_ptr() % 4 else s


def quantize(
    v: torch.Tensor,
    scales: torch.Tensor,
    scope: ScaleScope,
    *,
    page_size: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP8 of ``v / scale`` (see :func:`kvcodec.quant.quantize`), bit for bit."""
    quant.fp8_max(fp8_dtype)  # the reference's first check, and its message
    t, h, d = v.shape
    out = quant.output_for(out, (t, h, d), fp8_dtype, v.device, same_dtype=True)
    s = None
    page = _page(scope, page_size)
    if (
        fp8_dtype == torch.float8_e4m3fn
        and scope in _SCOPE_CODE
        and page is not None
        and _rows_ok(v, _DTYPE_CODE)
        and _out_ok(out, (fp8_dtype,))
    ):
        want = quant.scale_shape(scope, t, h, page)
        if tuple(scales.shape) != want:
            raise UnsupportedConfigError(
                f"scales of shape {tuple(scales.shape)} do not fit scope {scope.name} over "
                f"{t} tokens x {h} heads (page_size {page_size}); expected {want}"
            )
        s = _scales_f32(scales)
    if s is not None:
        met_nan = _cpu.quantize(
            v.data_ptr(), t, h, d, v.stride(0), v.stride(1), _DTYPE_CODE[v.dtype], s.data_ptr(), s.numel(),
            _SCOPE_CODE[scope], page, out.data_ptr(), out.stride(0), out.stride(1), 1,
        )  # fmt: skip
        if not met_nan:
            return out
    return quant.quantize(v, scales, scope, page_size=page_size, fp8_dtype=fp8_dtype, out=out)


def dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    scope: ScaleScope,
    *,
    page_size: int | None = None,
    out_dtype: torch.dtype = torch.float16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``float(q) * scale`` cast to ``out_dtype`` or into ``out`` (see :func:`kvcodec.quant.dequantize`)."""
    t, h, d = q.shape
    out = quant.output_for(out, (t, h, d), out_dtype, q.device, same_dtype=False)
    s = None
    page = _page(scope, page_size)
    if (
        scope in _SCOPE_CODE
        and page is not None
        and _rows_ok(q, (torch.float8_e4m3fn,))
        and _out_ok(out, _DTYPE_CODE)
        and tuple(scales.shape) == quant.scale_shape(scope, t, h, page)
    ):
        s = _aligned_f32(scales)
        if not bool(torch.isfinite(s).all()):
            s = None
    if s is not None:
        nan_codes = _cpu.dequantize(
            q.data_ptr(), t, h, d, q.stride(0), q.stride(1), s.data_ptr(), s.numel(), _SCOPE_CODE[scope],
            page, out.data_ptr(), out.stride(0), out.stride(1), _DTYPE_CODE[out.dtype], 1,
        )  # fmt: skip
        if not nan_codes:
            return out
    return quant.dequantize(q, scales, scope, page_size=page_size, out_dtype=out_dtype, out=out)


def copy_crc(dst: memoryview, src: memoryview, crc: int = 0) -> int:
    """Copy ``src``'s bytes into ``dst`` and return ``zlib.crc32(src, crc)``, reading ``src`` once.

    Byte semantics: ``dst`` (C-contiguous, writable) must hold exactly as many
    bytes as ``src``; overlapping buffers get the CRC of ``src`` as it was.
    """
    if not dst.c_contiguous:
        raise ValueError("copy_crc: dst must be C-contiguous")
    d = dst.cast("B")
    s = src.cast("B") if src.c_contiguous else memoryview(src.tobytes())
    if len(d) != len(s):
        raise ValueError(f"copy_crc: dst holds {len(d)} bytes, src {len(s)}")
    if _cpu is None:
        c = crc32(s, crc)
        d[:] = s
        return c
    return int(_cpu.copy_crc(d, s, crc & 0xFFFFFFFF, crc_threads() if len(s) >= _LONG else 1))


def empty_bytearray(n: int) -> bytearray:
    """A bytearray of ``n`` bytes for the caller to overwrite entirely (not zeroed; pages faulted in up front)."""
    return _cpu.empty_bytearray(n) if _cpu is not None else bytearray(n)


def can_encode_fused(
    k3: torch.Tensor | None,
    v3: torch.Tensor,
    scope: ScaleScope,
    fp8_dtype: torch.dtype,
    page_size: int | None = None,
) -> bool:
    """Whether :func:`encode_start` handles this chunk (otherwise use the three-step path)."""
    return (
        k3 is not None
        and scope in _SCOPE_CODE
        and _page(scope, page_size) is not None
        and fp8_dtype == torch.float8_e4m3fn
        and _rows_ok(v3, _DTYPE_CODE)
        and _rows_ok(k3, _DTYPE_CODE)
        and tuple(k3.shape) == tuple(v3.shape)
    )


def encode_chunk(
    k3: torch.Tensor,
    v3: torch.Tensor,
    scope: ScaleScope,
    page_size: int | None,
    k_out: torch.Tensor,
    q_out: torch.Tensor,
    s_out: torch.Tensor,
    crc: int,
) -> tuple[int, int]:
    """One chunk's payload: K copied, V's e4m3 codes and fp32 scales, and the CRC over all three.

    ``k_out`` (K's dtype) and ``q_out`` (e4m3) are dense ``[T, H, D]`` tensors
    and ``s_out`` the scales' bytes (uint8), all typically views into the blob at
    any alignment; ``crc`` is the CRC so far (the v2 header prefix's, or 0). The
    inputs must pass :func:`can_encode_fused`. Returns ``(status, crc)``: status
    -1 when done; otherwise V was not finished (NaN/Inf, a zero scale) and the
    reference must redo V and the scales (K is in place either way).
    """
    if not can_encode_fused(k3, v3, scope, torch.float8_e4m3fn, page_size):
        raise UnsupportedConfigError("encode_chunk: these inputs need the reference path (see can_encode_fused)")
    t, h, d = v3.shape
    shape = quant.scale_shape(scope, t, h, page_size)
    for name, x in (("k_out", k_out), ("q_out", q_out), ("s_out", s_out)):
        if not x.is_contiguous() or x.device.type != "cpu":
            raise UnsupportedConfigError(f"{name} must be a contiguous CPU tensor")
    if k_out.numel() != t * h * d or q_out.numel() != t * h * d or k_out.dtype != k3.dtype:
        raise UnsupportedConfigError("k_out/q_out do not match the chunk")
    if s_out.numel() * s_out.element_size() != 4 * math.prod(shape):
        raise UnsupportedConfigError(f"s_out does not hold {math.prod(shape)} fp32 scales")
    scratch = torch.empty(shape, dtype=torch.float32)
    status, out_crc, used = _cpu.encode_chunk(
        v3.data_ptr(), v3.stride(0), v3.stride(1), _DTYPE_CODE[v3.dtype], t, h, d, _SCOPE_CODE[scope],
        _page(scope, page_size), q_out.data_ptr(), scratch.data_ptr(), k3.data_ptr(), k3.stride(0),
        k3.stride(1), k3.element_size(), k_out.data_ptr(), s_out.data_ptr(), crc & 0xFFFFFFFF, threads(),
    )  # fmt: skip
    global LAST_ENCODE_THREADS
    LAST_ENCODE_THREADS = int(used)
    return int(status), int(out_crc)

"""Host side of the kernels: argument checks, FP8 constants, payload geometry, operand and layer addressing.

Torch only (no Triton): every launcher shares these. An operand is a
``[tokens, heads, head_dim]`` tensor per layer, addressed by element strides
(token, head, channel; plus a block stride when its rows go through a block
table) and by a layer step: a uniform stride, or a small device table of
per-layer element offsets when the layers are separate allocations.

Kernel argument names follow one scheme, written down in
:mod:`kvcodec.kernels.device`; :data:`STRIDE_ARGS` spells out each
operand's stride arguments, so every name a launcher passes can be found
by grep.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import Reason, UnsupportedConfigError
from ..numerics import FP8_DTYPES, ScaleScope, fp8_max, scale_shape
from .launch import INTERPRET, current_target, is_recording

__all__ = [
    "K_ELEM_VIEW",
    "OUT_KIND",
    "PAYLOAD_ALIGN",
    "PLANE_DTYPES",
    "STRIDE_ARGS",
    "V_DTYPES",
    "Fp8Constants",
    "Layers",
    "Rows",
    "as_layers",
    "bits16",
    "check_device",
    "check_fp8",
    "check_kv_meta",
    "check_payload",
    "check_scope",
    "check_tensor3",
    "dense_rows",
    "div_mode",
    "dummy_table",
    "empty_payloads",
    "fp8_constants",
    "hw_bf16",
    "hw_fp8",
    "int_view",
    "interpreted",
    "k_aligned",
    "listed",
    "n_scales",
    "out_kind",
    "out_view",
    "payload_aligned",
    "payload_bytes",
    "payload_layers",
    "payload_nbytes",
    "payload_stride",
    "pow2",
    "same_layout",
    "single",
    "sm_count",
    "stacked",
    "table_args",
]

V_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""V (and decoded V) dtypes the kernels read and write."""
PLANE_DTYPES = (torch.float16, torch.bfloat16)
"""K dtypes of the lossless payload's byte planes (16-bit: one high and one low byte per element)."""
K_ELEM_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
"""K moves as same-width integers: its bits pass through unchanged."""
OUT_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
"""The dequantize kernel's ``OUT_KIND`` constexpr per output dtype (bf16 stored as int16 bits)."""
PAYLOAD_ALIGN = 16
"""Bytes a stacked payload row is padded to (:func:`empty_payloads`): 128-bit accesses in every layer."""

STRIDE_ARGS: dict[str, tuple[str, str, str, str, str]] = {
    "k": ("k_st", "k_sh", "k_sd", "k_sb", "k_sl"),
    "v": ("v_st", "v_sh", "v_sd", "v_sb", "v_sl"),
    "ko": ("ko_st", "ko_sh", "ko_sd", "ko_sb", "ko_sl"),
    "vo": ("vo_st", "vo_sh", "vo_sd", "vo_sb", "vo_sl"),
}
"""Per operand, its (token, head, channel, block, layer) stride arguments."""


def pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


# ----------------------------------------------------------------------------
# Checks and targets
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Fp8Constants:
    """FP8 format constants the kernels take as constexprs (``MANT``, ``BIAS``, ``MAX_BITS``, ``SAT``) and ``qmax``."""

    mant: int
    bias: int
    max_bits: int
    sat: int
    qmax: float

    def args(self) -> dict[str, Any]:
        """The kernels' FP8 arguments."""
        return {"MANT": self.mant, "BIAS": self.bias, "MAX_BITS": self.max_bits, "SAT": self.sat}


@functools.lru_cache(maxsize=8)
def fp8_constants(dtype: torch.dtype) -> Fp8Constants:
    """Constants of an FP8 dtype (:class:`UnsupportedConfigError` for any other dtype)."""
    qmax = fp8_max(dtype)
    max_bits = struct.unpack("<i", struct.pack("<f", qmax))[0]
    if dtype == torch.float8_e4m3fn:
        return Fp8Constants(3, 7, max_bits, 0x7E, qmax)
    return Fp8Constants(2, 15, max_bits, 0x7B, qmax)


def check_scope(scope: ScaleScope, page_size: int | None) -> ScaleScope:
    """``scope`` as a :class:`ScaleScope` with computed scales (and a page size for per_page_head)."""
    try:
        scope = ScaleScope(scope)
    except ValueError:
        raise UnsupportedConfigError(f"unknown scale scope {scope!r}", reason=Reason.BAD_SCOPE) from None
    if scope == ScaleScope.PER_PAGE_HEAD and (not page_size or page_size < 1):
        raise UnsupportedConfigError(
            f"per_page_head needs page_size >= 1; got {page_size}", reason=Reason.BAD_VALUE
        )
    scale_shape(scope, 1, 1, page_size)  # raises for scopes without computed scales
    return scope


def check_device(*ts: torch.Tensor) -> torch.device:
    """The one device of ``ts``; CPU only in Triton's interpreter (or while recording launches)."""
    dev = ts[0].device
    for t in ts[1:]:
        if t.device != dev:
            raise UnsupportedConfigError(
                f"tensors on different devices: {dev} and {t.device}", reason=Reason.BAD_DEVICE
            )
    if dev.type == "cpu" and not INTERPRET and not is_recording():
        raise UnsupportedConfigError(
            "Triton kernels need GPU tensors; for CPU tensors set TRITON_INTERPRET=1 "
            "before kvcodec.kernels is imported",
            reason=Reason.BAD_DEVICE,
        )
    return dev


def check_tensor3(name: str, x: torch.Tensor, dtypes: Sequence[torch.dtype] | None = None) -> None:
    """``x`` is ``[tokens, heads, head_dim]`` (of one of ``dtypes``)."""
    if x.dim() != 3:
        raise UnsupportedConfigError(
            f"expected {name} as [tokens, heads, head_dim]; got shape {tuple(x.shape)}",
            reason=Reason.BAD_SHAPE,
        )
    if dtypes is not None and x.dtype not in dtypes:
        raise UnsupportedConfigError(
            f"{name} dtype {x.dtype} unsupported; expected one of {tuple(dtypes)}",
            reason=Reason.UNSUPPORTED_DTYPE,
        )


def check_fp8(q: torch.Tensor) -> None:
    """``q`` holds FP8 codes."""
    if q.dtype not in FP8_DTYPES:
        raise UnsupportedConfigError(
            f"q dtype {q.dtype} is not FP8; expected one of {FP8_DTYPES}", reason=Reason.UNSUPPORTED_DTYPE
        )


def check_kv_meta(
    kshape: tuple[int, ...], vshape: tuple[int, ...], kdt: torch.dtype, vdt: torch.dtype
) -> None:
    """K and V are same-shaped ``[T, H, D]``, V of :data:`V_DTYPES`, K of 1, 2 or 4 bytes."""
    if len(kshape) != 3 or len(vshape) != 3:
        raise UnsupportedConfigError(
            f"expected K and V as [tokens, heads, head_dim]; got {kshape} and {vshape}",
            reason=Reason.BAD_SHAPE,
        )
    if kshape != vshape:
        raise UnsupportedConfigError(f"K {kshape} and V {vshape} differ in shape", reason=Reason.BAD_SHAPE)
    if vdt not in V_DTYPES:
        raise UnsupportedConfigError(
            f"V dtype {vdt} unsupported; expected one of {V_DTYPES}", reason=Reason.UNSUPPORTED_DTYPE
        )
    if kdt.itemsize not in K_ELEM_VIEW or not (kdt.is_floating_point or kdt == torch.uint8):
        raise UnsupportedConfigError(f"K dtype {kdt} unsupported", reason=Reason.UNSUPPORTED_DTYPE)


def sm_count(dev: torch.device) -> int:
    """Streaming multiprocessors of the target launches on ``dev`` are planned for."""
    return current_target(dev).sm_count


def interpreted(dev: torch.device) -> bool:
    """True when launches on ``dev`` are planned for the interpreter."""
    return current_target(dev).interpret


def hw_fp8(dev: torch.device) -> bool:
    """Use the hardware FP8 converters (sm_89+; ``KVCODEC_HW_FP8=0`` turns them off)."""
    return current_target(dev).hw_fp8


def hw_bf16(dev: torch.device) -> bool:
    """Round fp32 to bf16 with the hardware convert (compiled CUDA on sm_80+; the interpreter truncates)."""
    return current_target(dev).hw_bf16


_DUMMY: dict[torch.device, torch.Tensor] = {}


def dummy_table(dev: torch.device) -> torch.Tensor:
    """A tiny int64 tensor standing in for unused pointer arguments (cached per device)."""
    t = _DUMMY.get(dev)
    if t is None:
        t = _DUMMY[dev] = torch.zeros(1, dtype=torch.int64, device=dev)
    return t


def bits16(x: torch.Tensor) -> torch.Tensor:
    """bf16 as its int16 bits (kernels widen it by a shift); other dtypes unchanged."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def int_view(x: torch.Tensor) -> torch.Tensor:
    """Same-width integer view of ``x`` (bits move unchanged through kernels)."""
    try:
        return x.view(K_ELEM_VIEW[x.element_size()])
    except KeyError:
        raise UnsupportedConfigError(
            f"dtype {x.dtype} of {x.element_size()} bytes unsupported", reason=Reason.UNSUPPORTED_DTYPE
        ) from None


def out_kind(dt: torch.dtype) -> int:
    """The dequantize kernel's ``OUT_KIND`` for output dtype ``dt``."""
    try:
        return OUT_KIND[dt]
    except KeyError:
        raise UnsupportedConfigError(
            f"output dtype {dt} unsupported; expected fp32, fp16 or bf16", reason=Reason.UNSUPPORTED_DTYPE
        ) from None


def out_view(out: torch.Tensor) -> tuple[torch.Tensor, int]:
    """An output as the kernels see it (bf16 as int16 bits) and its ``OUT_KIND``."""
    kind = out_kind(out.dtype)
    return (out.view(torch.int16) if kind == 2 else out), kind


# ----------------------------------------------------------------------------
# Layers and rows
# ----------------------------------------------------------------------------


@dataclass
class Layers:
    """Per-layer addressing of same-shaped tensors: base tensor plus stride or offset table."""

    base: torch.Tensor
    stride: int
    table: torch.Tensor | None
    count: int
    offsets: tuple[int, ...] = ()
    """Host copy of the table's element offsets (no device sync to inspect them)."""
    mult: int = 1
    """Every table offset is a multiple of this many elements (16 bytes' worth when possible)."""


def single(x: torch.Tensor) -> Layers:
    """One tensor as a single layer."""
    return Layers(x, 0, None, 1)


def stacked(x: torch.Tensor, view: torch.dtype | None = None) -> Layers:
    """Addressing of a stacked ``[L, ...]`` tensor (layer = dim 0; the tensor itself is the pointer)."""
    base = x if view is None else x.view(view)
    return Layers(base, x.stride(0) if x.shape[0] > 1 else 0, None, x.shape[0])


def listed(xs: Sequence[torch.Tensor], view: torch.dtype | None = None) -> Layers:
    """Addressing of separate same-shaped tensors: uniform stride if possible, else an offset table."""
    base = xs[0] if view is None else xs[0].view(view)
    es = base.element_size()
    p0 = base.data_ptr()
    offs = []
    for x in xs:
        d = x.data_ptr() - p0
        if d % es:
            raise UnsupportedConfigError(
                "layer tensors are not aligned to their element size", reason=Reason.BAD_SHAPE
            )
        offs.append(d // es)
    if len(offs) == 1:
        return single(base)
    step = offs[1]
    if all(o == i * step for i, o in enumerate(offs)):
        return Layers(base, step, None, len(offs))
    table = torch.tensor(offs, dtype=torch.int64).to(base.device, non_blocking=True)
    vec = max(1, PAYLOAD_ALIGN // es)
    mult = vec if all(o % vec == 0 for o in offs) else 1
    return Layers(base, 0, table, len(offs), tuple(offs), mult)


def table_args(lay: Layers, dummy: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(layer offset table or ``dummy``, its ``*_TAB`` constexpr: 0 without a table, else the offsets' multiple)."""
    if lay.table is None:
        return dummy, 0
    return lay.table, lay.mult


def same_layout(xs: Sequence[torch.Tensor], what: str) -> None:
    """Every tensor of ``xs`` has the first one's shape, strides, dtype and device."""
    x0 = xs[0]
    for x in xs[1:]:
        if x.shape != x0.shape or x.stride() != x0.stride() or x.dtype != x0.dtype or x.device != x0.device:
            raise UnsupportedConfigError(
                f"all {what} must share shape, strides, dtype and device; got {tuple(x0.shape)}/"
                f"{x0.stride()}/{x0.dtype} and {tuple(x.shape)}/{x.stride()}/{x.dtype}",
                reason=Reason.BAD_SHAPE,
            )


@dataclass
class Rows:
    """A [tokens, heads, head_dim] operand per layer: dense strides, or paged through a block table."""

    layers: Layers
    s_tok: int
    s_h: int
    s_d: int
    s_blk: int = 0

    def stride_args(self, operand: str) -> dict[str, int]:
        """The kernel's stride arguments of ``operand`` (a key of :data:`STRIDE_ARGS`)."""
        return dict(
            zip(STRIDE_ARGS[operand], (self.s_tok, self.s_h, self.s_d, self.s_blk, self.layers.stride))
        )


def dense_rows(layers: Layers, strides: Sequence[int] | None = None) -> Rows:
    """Rows addressed by (token, head, channel) strides: ``strides``, else the base tensor's."""
    st = strides if strides is not None else layers.base.stride()
    return Rows(layers, st[0], st[1], st[2])


def _view_for(dt: torch.dtype, kind: str) -> torch.dtype | None:
    """The dtype kernels see an operand as: same-width ints for K bits, int16 for bf16 V/outputs."""
    if kind == "k":
        view = K_ELEM_VIEW.get(dt.itemsize)
        if view is None:
            raise UnsupportedConfigError(
                f"dtype {dt} of {dt.itemsize} bytes unsupported", reason=Reason.UNSUPPORTED_DTYPE
            )
        return view
    if kind == "v" and dt == torch.bfloat16:
        return torch.int16
    return None


def as_layers(
    xs: Sequence[torch.Tensor] | torch.Tensor, what: str, kind: str = ""
) -> tuple[Layers, tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]:
    """Layers of a stacked ``[L, ...]`` tensor or a list: (addressing, per-layer shape, strides, dtype, device).

    ``kind``: ``"k"`` views K as same-width integers, ``"v"`` views bf16 as int16 bits.
    """
    if isinstance(xs, torch.Tensor):
        if xs.dim() < 2 or xs.shape[0] == 0:
            raise UnsupportedConfigError(
                f"stacked {what} need a non-empty leading layer dim; got {tuple(xs.shape)}",
                reason=Reason.BAD_SHAPE,
            )
        dt = xs.dtype
        return stacked(xs, _view_for(dt, kind)), tuple(xs.shape[1:]), xs.stride()[1:], dt, xs.device
    xs = list(xs)
    if not xs:
        raise UnsupportedConfigError(f"no {what} given", reason=Reason.MISSING_ARGUMENT)
    same_layout(xs, what)
    x0 = xs[0]
    return listed(xs, _view_for(x0.dtype, kind)), tuple(x0.shape), x0.stride(), x0.dtype, x0.device


# ----------------------------------------------------------------------------
# Payloads
# ----------------------------------------------------------------------------


def n_scales(scope: ScaleScope, t: int, h: int, page_size: int | None) -> int:
    """Scales a scope gives for ``t`` tokens x ``h`` heads."""
    return math.prod(scale_shape(scope, t, h, page_size))


def payload_bytes(t: int, h: int, d: int, kb: int, scope: ScaleScope, page_size: int | None) -> int:
    """Bytes of a ``[t, h, d]`` chunk's payload with ``kb``-byte K."""
    return t * h * d * (kb + 1) + 4 * n_scales(scope, t, h, page_size)


def payload_nbytes(k: torch.Tensor, v: torch.Tensor, scope: ScaleScope, page_size: int | None = None) -> int:
    """Bytes of the LMCKV payload ``K ‖ V(FP8) ‖ scales(fp32)`` of one ``[T, H, D]`` chunk."""
    t, h, _ = v.shape
    return k.numel() * k.element_size() + v.numel() + 4 * n_scales(scope, t, h, page_size)


def payload_stride(nbytes: int) -> int:
    """Bytes between stacked payload rows of ``nbytes``: rounded up to :data:`PAYLOAD_ALIGN`."""
    return -(-max(int(nbytes), 1) // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def empty_payloads(layers: int, nbytes: int, device: torch.device | str) -> torch.Tensor:
    """Uninitialised stacked payloads ``[layers, nbytes]`` whose rows start 16 bytes apart.

    The rows of a plain ``torch.empty((layers, nbytes))`` are only as aligned
    as ``nbytes`` (per_tensor payloads end in 4 scale bytes), which forces
    byte-wide accesses in every layer after the first; padding each row to
    :data:`PAYLOAD_ALIGN` bytes keeps the fused kernels' 128-bit accesses.
    """
    stride = payload_stride(nbytes)
    return torch.empty((int(layers), stride), dtype=torch.uint8, device=device)[:, : int(nbytes)]


def check_payload(p: torch.Tensor, want: int) -> None:
    """``p`` is one contiguous 1-D uint8 payload of exactly ``want`` bytes."""
    if p.dtype != torch.uint8 or p.dim() != 1:
        raise UnsupportedConfigError(
            f"payload must be a 1-D uint8 tensor; got {p.dim()}-D {p.dtype}", reason=Reason.BAD_OUTPUT
        )
    if p.numel() != want:
        raise UnsupportedConfigError(
            f"payload holds {p.numel()} bytes; the chunk needs exactly {want}", reason=Reason.BAD_OUTPUT
        )
    if p.numel() > 1 and p.stride(0) != 1:
        raise UnsupportedConfigError("payload must be contiguous", reason=Reason.BAD_OUTPUT)


def payload_layers(payloads: Sequence[torch.Tensor] | torch.Tensor, want: int) -> Layers:
    """Payloads as layers (a stacked ``[L, nbytes]`` uint8 tensor or a list), size-checked."""
    lay, shp, st, dt, _ = as_layers(payloads, "payloads")
    if dt != torch.uint8 or len(shp) != 1:
        raise UnsupportedConfigError(
            f"payloads must be 1-D uint8 (or stacked [L, nbytes]); got {shp} {dt}", reason=Reason.BAD_OUTPUT
        )
    if shp[0] != want:
        raise UnsupportedConfigError(
            f"payload holds {shp[0]} bytes; the chunk needs exactly {want}", reason=Reason.BAD_OUTPUT
        )
    if want > 1 and st[0] != 1:
        raise UnsupportedConfigError("payload must be contiguous", reason=Reason.BAD_OUTPUT)
    return lay


def k_aligned(pay: Layers, kb: int) -> bool:
    """K elements of ``kb`` bytes land aligned in every payload (word stores instead of byte stores)."""
    return payload_aligned(pay, 0, kb)


def payload_aligned(pay: Layers, offset: int, mult: int) -> bool:
    """Byte ``offset`` of every layer's payload is a multiple of ``mult`` bytes in memory."""
    if pay.base.data_ptr() % mult or pay.stride % mult or offset % mult:
        return False
    return pay.table is None or all(o % mult == 0 for o in pay.offsets)


def div_mode(v_dtype: torch.dtype) -> int:
    """The kernels' ``DIV`` for V of ``v_dtype`` (:func:`.device.div_by_scale`): one reciprocal per group where proven exact."""
    return {torch.float16: 1, torch.bfloat16: 2}.get(v_dtype, 0)

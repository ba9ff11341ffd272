"""The ``cpu`` backend: the FP8 row loops in C (``kvcodec._cpu``), bit-exact with :mod:`.reference`.

torch's fp32 -> e4m3 cast and its FP8 widening are scalar loops on CPU; the C
loops do the same arithmetic (IEEE division, round to nearest even, the same
saturation) eight lanes at a time. Each call runs on the calling thread with
the GIL released, so a caller's thread pool scales across chunks; the
extension starts no threads.

Tensors cross into C as buffers (numpy views of the tensors). This module
declines (:class:`~.base.Declined`) what the loops do not handle as a tensor
(device, dtype, scope, page size, lazy views: :func:`_refusal`); the C side
checks every buffer's shape, strides, alignment and overlaps and declines a
layout it does not take, or data it cannot reproduce bit for bit (NaN, unusable
scales); the dispatcher then runs the reference over the whole output.
``encode_v`` of per_page_head 16-bit V goes page by page (a page's scales,
then its codes while its rows are in cache: V read from memory once) and may
have written the pages before one it declines; other scopes decline before
writing any code; ``quantize``/``dequantize`` may have written the rows before
one holding NaN. The extension is optional (built at install when a C compiler is present):
:data:`AVAILABLE` says whether it is and :data:`REASON` why not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import Reason, UnsupportedConfigError
from ..format.crc import crc32
from ..hostmem import copy_tensor
from ..numerics import NonFinitePolicy, ScaleScope, scale_shape
from .base import BlobRows, Declined, Groups, Lanes, Served

__all__ = [
    "AVAILABLE",
    "BACKEND",
    "REASON",
    "BlobRows",
    "CpuBackend",
    "huff_decode",
    "huff_decode_many",
    "huff_encode",
    "huff_encode_many",
    "huff_encode_pairs_many",
    "k_planes",
    "lossless_expand",
    "scatter_blob_rows",
    "scatter_dequantize",
    "v_nibbles",
    "v_nibbles_pairs",
]


class _CArgumentError(UnsupportedConfigError):
    """What the C extension raises for an argument no caller can mean (a 2-D buffer, a wrong item
    size or number of scales, an unknown code): a buffer it cannot take."""

    default_reason = Reason.BAD_BUFFER


try:
    from .. import _cpu  # type: ignore[attr-defined]
except ImportError as e:  # pragma: no cover - depends on the install
    _cpu = None
    REASON = f"kvcodec._cpu is not built ({e}); reinstall with a C compiler present"
else:
    _cpu.set_error(_CArgumentError)
    REASON = ""

AVAILABLE: bool = _cpu is not None


def k_planes(k: Any, hi: Any, lo: Any, tokens: int, heads: int, dim: int, merge: bool) -> bool:
    """16-bit K's bytes split into (``merge=False``) or merged from (True) its high plane
    ``[heads, dim, tokens]`` and low plane ``[tokens, heads, dim]`` by planes.c, in one pass; False
    (nothing done) when the C loops are not built."""
    if _cpu is None:
        return False
    _cpu.k_planes(k, hi, lo, tokens, heads, dim, merge)
    return True


def v_nibbles(v: Any, exp: Any, nib: Any, tokens: int, heads: int, dim: int, merge: bool) -> bool:
    """V's FP8 codes ``[tokens, heads, dim]`` split into (``merge=False``) or merged from (True) each
    head's exponents ``[heads, tokens x dim]`` and the codes' sign + mantissa nibbles, two a byte in
    payload order, by nibbles.c, in one pass; False (nothing done) when the C loops are not built."""
    if _cpu is None:
        return False
    _cpu.v_nibbles(v, exp, nib, tokens, heads, dim, merge)
    return True


def v_nibbles_pairs(v: Any, exp2: Any, nib: Any, tokens: int, heads: int, dim: int) -> bool:
    """:func:`v_nibbles`' split with each head's exponents two a byte (``exp2``: half the codes' bytes),
    what :func:`huff_encode_pairs_many` codes; False when the C loops are not built."""
    if _cpu is None:
        return False
    _cpu.v_nibbles_pairs(v, exp2, nib, tokens, heads, dim)
    return True


def lossless_expand(
    payload: Any,
    k_len: int,
    v_len: int,
    k_streams: Sequence[tuple[int, int]],
    k_raw_at: int,
    v_streams: Sequence[tuple[int, int]],
    v_raw_at: int,
    shape: tuple[int, int, int],
    k_out: Any,
    v_out: Any,
    plane: Any,
    crc: tuple[Any, int] | None,
    deq: tuple[Any, ...] | None = None,
) -> bool | str | tuple[Any, ...]:
    """A split lossless payload's K bytes and V codes in one C call (py_lossless.c: one GIL hand-over a
    blob): True when written, ``("crc", got)`` when ``crc`` (the header prefix and the stored CRC) does not
    match (nothing decoded), ``("V" | "K", i, code)`` for the first stream refused; False when the C
    loops are not built. With ``deq`` (:meth:`ExpandDequant.args`; ``v_out`` then the codes as
    ``[T, H, D]``) the codes are dequantized in the same call: a str when C declined that (a layout it
    does not take, or NaN codes: the dequantized output may be partly written), all else written."""
    if _cpu is None:
        return False
    tokens, heads, dim = shape
    got = _cpu.lossless_expand(
        payload,
        k_len,
        v_len,
        k_streams,
        k_raw_at,
        v_streams,
        v_raw_at,
        tokens,
        heads,
        dim,
        k_out,
        v_out,
        plane,
        crc,
        deq,
    )
    return True if got is None else got if isinstance(got, str) else tuple(got)


def huff_encode(src: Any, at: int, n: int, row: int, stride: int, out: Any, out_at: int) -> int | None:
    """The Huffman stream (huff.c) of the ``n`` symbols ``src[at + (j // row) * stride + j % row]``
    written at ``out[out_at:]``: its length, -1 when it does not fit there, None when the C loops are
    not built."""
    if _cpu is None:
        return None
    return int(_cpu.huff_encode(src, at, n, row, stride, out, out_at))


def huff_decode(
    src: Any, at: int, length: int, n: int, out: Any, out_at: int, row: int, stride: int
) -> int | None:
    """Huffman stream ``src[at : at + length]`` decoded by huff.c to ``n`` symbols written as
    :func:`huff_encode` reads them: 0, a refusal code (``kvcodec.format.coding.HUFF_ERRORS``), or None
    when the C loops are not built."""
    if _cpu is None:
        return None
    return int(_cpu.huff_decode(src, at, length, n, out, out_at, row, stride))


def huff_encode_many(
    src: Any, at: int, step: int, count: int, n: int, row: int, stride: int, out: Any, out_at: int
) -> list[int] | None:
    """``count`` streams, stream i of the symbols from ``at + i * step``, written one after another from
    ``out[out_at:]`` in one call: their lengths; None when the C loops are not built. A section: the
    streams share code lengths where that costs each little (``kvcodec.codec.huffman.encode_section``'s
    bytes; one stream alone is :func:`huff_encode`'s)."""
    if _cpu is None:
        return None
    return list(_cpu.huff_encode_many(src, at, step, count, n, row, stride, out, out_at))


def huff_encode_pairs_many(
    src: Any, at: int, step: int, count: int, n: int, out: Any, out_at: int
) -> list[int] | None:
    """:func:`huff_encode_many` of ``count`` streams of ``n`` symbols below 16 (``n`` a multiple of 8), stream
    i's two a byte in the ``n / 2`` bytes from ``at + i * step``: the same bytes, coded two symbols a
    lookup; None when the C loops are not built."""
    if _cpu is None:
        return None
    return list(_cpu.huff_encode_pairs_many(src, at, step, count, n, out, out_at))


def huff_decode_many(
    src: Any,
    streams: Sequence[tuple[int, int]],
    n: int,
    out: Any,
    out_at: int,
    out_step: int,
    row: int,
    stride: int,
) -> tuple[int, int] | bool | None:
    """Each ``(offset, length)`` of ``streams`` decoded (:func:`huff_decode`) to ``n`` symbols written from
    ``out_at + i * out_step``, in one call: True when all decoded, ``(i, code)`` for the first refused,
    None when the C loops are not built."""
    if _cpu is None:
        return None
    got = _cpu.huff_decode_many(src, streams, n, out, out_at, out_step, row, stride)
    return True if got is None else (int(got[0]), int(got[1]))


"""Whether the C extension is built and importable."""

_DTYPE = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
"""The C side's dtype codes (its FP16, BF16, FP32)."""
_SCOPE = {ScaleScope.PER_TENSOR: 0, ScaleScope.PER_LAYER_HEAD: 1, ScaleScope.PER_PAGE_HEAD: 2}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
"""Same-size integer dtypes numpy can export for any of our element types."""
_E4M3 = torch.float8_e4m3fn
_ENCODE = (tuple(_DTYPE), (_E4M3,))
"""What encode_v and quantize read and write; dequantize the other way round."""
_DECODE = ((_E4M3,), tuple(_DTYPE))
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _rows_refusal(x: torch.Tensor, dtypes: object, name: str) -> str | None:
    """Why the C loops cannot read or write ``x`` as ``[T, H, D]`` rows (None when they can)."""
    if type(x) not in _PLAIN:
        return f"{name} is a {type(x).__name__}, not a plain tensor"
    if not x.is_cpu or x.layout != torch.strided or x.is_nested:  # is_cpu: no device object made
        return f"{name} is not a strided CPU tensor"
    if x.dtype not in dtypes:  # type: ignore[operator]
        return f"{name} is {x.dtype}"
    shape = x.shape
    if len(shape) != 3 or 0 in shape:
        return f"{name} is not a non-empty [tokens, heads, head_dim] tensor"
    if x.is_neg() or x.is_conj():
        return f"{name} is a lazily negated or conjugated view"
    return None


def _out_refusal(out: torch.Tensor, dtypes: object, shape: torch.Size) -> str | None:
    """Why the C loops cannot write ``out`` (None when they can; C checks its layout and overlaps)."""
    why = _rows_refusal(out, dtypes, "out")
    if why is None and out.shape != shape:
        why = f"out is {tuple(out.shape)}, not {tuple(shape)}"
    if why is None and out.requires_grad:
        why = "out requires grad"
    return why


def _page(groups: Groups) -> int | str:
    """The page size C gets (1 outside per_page_head), or why there are no C loops for ``groups``."""
    if _cpu is None:
        return REASON
    if groups.fp8_dtype != _E4M3:
        return f"{groups.fp8_dtype} has no C loops (e4m3fn only)"
    if groups.scope not in _SCOPE:
        return f"scope {groups.scope!r} has no C loops"
    if groups.scope != ScaleScope.PER_PAGE_HEAD:
        return 1
    ps = groups.page_size
    return ps if type(ps) is int and ps >= 1 else f"page_size {ps!r} is not an int >= 1"


def _refusal(
    x: torch.Tensor, groups: Groups, out: torch.Tensor, dtypes: tuple[object, object], scales: Any = None
) -> str | int:
    """The one list of what the C loops decline: a reason, or the page size to pass on.

    ``x`` is the input rows (V, or codes for dequantize), ``dtypes`` the dtypes
    C reads and writes, ``scales`` the caller's (None for encode_v, whose
    scales C computes).
    """
    page = _page(groups)
    if isinstance(page, str):
        return page
    why = _rows_refusal(x, dtypes[0], "input")
    if why is None and scales is not None:
        why = _scales_refusal(scales, groups, x.shape, page)
    if why is None:
        why = _out_refusal(out, dtypes[1], x.shape)
    return page if why is None else why


def _scales_refusal(scales: Any, groups: Groups, shape: torch.Size, page: int) -> str | None:
    """Why the caller's scales are not for C (None when they are)."""
    if not isinstance(scales, torch.Tensor) or not scales.is_cpu or scales.layout != torch.strided:
        return "scales are not a strided CPU tensor"
    if not scales.dtype.is_floating_point:
        return f"scales are {scales.dtype}"
    if tuple(scales.shape) != scale_shape(groups.scope, shape[0], shape[1], page):
        return f"scales of shape {tuple(scales.shape)} do not fit the scope"
    return None


_NUMPY_NATIVE = (torch.float16, torch.float32)


def _buf(x: torch.Tensor) -> Any:
    """A numpy view of ``x`` for C (bf16 and fp8, which numpy lacks, as same-size integers)."""
    if x.requires_grad:
        x = x.detach()
    return x.numpy() if x.dtype in _NUMPY_NATIVE else x.view(_INT_VIEW[x.element_size()]).numpy()


def _scales32(scales: torch.Tensor) -> Any:
    """The caller's scales for C: themselves when dense fp32 (so C sees any overlap with the
    output), else a dense fp32 copy taken now."""
    s = scales.detach() if scales.requires_grad else scales
    if s.is_neg():
        s = s.resolve_neg()
    if s.dtype != torch.float32 or not s.is_contiguous():
        s = s.to(torch.float32).contiguous()
    return s.numpy()


def _byte_copy(k: torch.Tensor | None, k_out: torch.Tensor | None) -> tuple[Any, Any]:
    """K's bytes and their destination for C to copy beside V, or (None, None) when not contiguous."""
    if k is None or k_out is None or not (k.is_contiguous() and k_out.is_contiguous()) or k.numel() == 0:
        return None, None
    return _buf(k).reshape(-1).view(np.uint8), _buf(k_out).reshape(-1).view(np.uint8)


_HOST_SCALES = (torch.float32, torch.float16)
"""Scale dtypes the host lane stores (numpy has both)."""


def _host_refusal(k: torch.Tensor, v: torch.Tensor, groups: Groups) -> str | int:
    """:func:`_refusal` for the host lane: V as rows, K C-contiguous with V's shape; or the page size."""
    page = _page(groups)
    if isinstance(page, str):
        return page
    why = _rows_refusal(v, _ENCODE[0], "input") or _rows_refusal(k, _ENCODE[0], "k")
    if why is None and (k.shape != v.shape or not k.is_contiguous()):
        why = "K is not C-contiguous with V's shape"
    return page if why is None else why


def _declined(why: str | None) -> None:
    """Raise C's reason for handing the call to the reference."""
    if why is not None:
        raise Declined(why)


def _served(got: str | int | None) -> Served:
    """What a C call returned as one typed result: its CRC when it carried one (None: C left it to the
    caller, or no seed was given), or raise its reason to decline."""
    if isinstance(got, str):
        raise Declined(got)
    return Served(got)


@dataclass(frozen=True)
class ExpandDequant:
    """:meth:`CpuBackend.expand_dequant`'s plan: the C codes of V's scope, page size and output dtype."""

    scope: int
    page: int
    out_dtype: int

    def args(self, scales: torch.Tensor, out_v: torch.Tensor) -> tuple[Any, ...]:
        """``lossless_expand``'s ``deq`` for these scales and ``out_v`` (as checked when planned)."""
        return _scales32(scales), self.scope, self.page, _buf(out_v), self.out_dtype


class CpuBackend(Lanes):
    """The :class:`~.base.Backend` of the C loops (CPU tensors, e4m3fn; see :func:`_refusal`), with the
    host lanes (a blob payload in one C call) and the cache lanes (rows into a paged cache view)."""

    name = "cpu"
    lanes = frozenset(
        {"encode_host", "decode_host", "expand_dequant", "scatter_rows", "scatter_blob_rows_many"}
    )

    def encode_v(
        self,
        v: torch.Tensor,
        groups: Groups,
        *,
        scale_dtype: torch.dtype,
        nonfinite: NonFinitePolicy,
        out: torch.Tensor,
        k: torch.Tensor | None = None,
        k_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """V's scales (as stored, ``scale_dtype``) and its e4m3 codes into ``out``, in one C call
        (which also copies ``k`` into ``k_out`` when both are contiguous)."""
        if nonfinite != "error":
            raise Declined(f"nonfinite={nonfinite!r} has no C loops")
        if scale_dtype not in _DTYPE:
            raise Declined(f"scale_dtype {scale_dtype} has no C loops")
        page = _refusal(v, groups, out, _ENCODE)
        if isinstance(page, str):
            raise Declined(page)
        t, h, _ = v.shape
        s32 = np.empty(scale_shape(groups.scope, t, h, page), np.float32)
        copy = _byte_copy(k, k_out)
        _declined(
            _cpu.encode_v(
                _buf(v),
                _DTYPE[v.dtype],
                _SCOPE[groups.scope],
                page,
                _DTYPE[scale_dtype],
                _buf(out),
                s32,
                *copy,
            )
        )
        if copy[0] is None and k is not None:
            copy_tensor(k_out, k)  # K strided: numpy's copy, still on this thread
        scales = torch.from_numpy(s32)
        return scales if scale_dtype == torch.float32 else scales.to(scale_dtype)

    def encode_kv(
        self,
        k: torch.Tensor,
        k_out: torch.Tensor,
        v: torch.Tensor,
        groups: Groups,
        *,
        scale_dtype: torch.dtype,
        nonfinite: NonFinitePolicy,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`encode_v`, with K's bytes copied into ``k_out`` in the same C call (one GIL release)."""
        return self.encode_v(
            v, groups, scale_dtype=scale_dtype, nonfinite=nonfinite, out=out, k=k, k_out=k_out
        )

    def encode_host(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        groups: Groups,
        payload: memoryview,
        *,
        scale_dtype: torch.dtype,
        nonfinite: NonFinitePolicy,
        crc: int | None = None,
        k_copy: bool = True,
    ) -> Served:
        """``K ‖ e4m3(V) ‖ scales`` straight into a host blob payload, in one C call (``k_copy=False``: K's
        bytes left unwritten, for a caller that codes K from ``k`` itself; no CRC then).

        The optional host lane of the codec (see :mod:`.base`): no tensor is
        made over the payload (numpy views only), so an encode takes the GIL
        off once, for the C call. ``k`` must be C-contiguous with V's shape;
        anything else declines and the codec takes the generic path. With
        ``crc`` (the CRC so far: the header's, or 0) the result's ``crc`` is that
        CRC continued over the whole payload, folded into the pass that writes it
        (each slice checksummed while in cache), or None when C could not fold it
        (the caller then computes it); without ``crc``, None.
        """
        if nonfinite != "error" or scale_dtype not in _HOST_SCALES:
            raise Declined(f"nonfinite={nonfinite!r} / scale_dtype {scale_dtype} take the generic path")
        if not k_copy and crc is not None:
            raise Declined("a CRC over the payload needs K's bytes written")
        page = _host_refusal(k, v, groups)
        if isinstance(page, str):
            raise Declined(page)
        t, h, _ = v.shape
        k_len, v_len = k.numel() * k.element_size(), v.numel()
        s32 = np.empty(scale_shape(groups.scope, t, h, page), np.float32)
        if k_len + v_len + s32.size * scale_dtype.itemsize != len(payload):
            raise Declined("the payload does not hold exactly K, V's codes and the scales")
        q = np.frombuffer(payload, np.uint8, v_len, k_len).reshape(v.shape)
        args = [_buf(v), _DTYPE[v.dtype], _SCOPE[groups.scope], page, _DTYPE[scale_dtype], q, s32]
        if k_copy:
            args += [_buf(k).reshape(-1).view(np.uint8), np.frombuffer(payload, np.uint8, k_len), crc]
        got = _served(_cpu.encode_v(*args))
        stored = s32 if scale_dtype == torch.float32 else s32.astype(np.float16)
        payload[k_len + v_len :] = stored.reshape(-1).view(np.uint8)
        return got if got.crc is None else Served(crc32(payload[k_len + v_len :], got.crc))

    def quantize(
        self, v: torch.Tensor, scales: torch.Tensor, groups: Groups, *, out: torch.Tensor
    ) -> torch.Tensor:
        """e4m3 codes of ``v / scale`` into ``out`` (finite, positive scales; NaN in V declines)."""
        page = _refusal(v, groups, out, _ENCODE, scales)
        if isinstance(page, str):
            raise Declined(page)
        s = _scales32(scales)
        _declined(_cpu.quantize(_buf(v), _DTYPE[v.dtype], s, _SCOPE[groups.scope], page, _buf(out)))
        return out

    def dequantize(
        self, q: torch.Tensor, scales: torch.Tensor, groups: Groups, *, out: torch.Tensor
    ) -> torch.Tensor:
        """``float(q) * scale`` into ``out`` (fp16, bf16 or fp32; NaN codes or non-finite scales decline)."""
        page = _refusal(q, groups, out, _DECODE, scales)
        if isinstance(page, str):
            raise Declined(page)
        s = _scales32(scales)
        _declined(_cpu.dequantize(_buf(q), s, _SCOPE[groups.scope], page, _buf(out), _DTYPE[out.dtype]))
        return out

    def decode_host(
        self,
        payload: memoryview,
        k_len: int,
        scales: torch.Tensor,
        groups: Groups,
        out_k: torch.Tensor,
        out_v: torch.Tensor,
        *,
        crc: int | None = None,
        k_done: bool = False,
    ) -> Served:
        """A host blob payload's K bytes into ``out_k`` and its codes dequantized into ``out_v``, in one C call
        (``k_done``: the codes alone, ``out_k`` holding K already; no CRC then).

        ``payload`` is ``K (k_len bytes) ‖ codes (out_v's elements) ‖ ...``; ``out_k`` is C-contiguous
        and holds exactly ``k_len`` bytes. With ``crc`` (the CRC so far: the header's, or 0) the result's
        ``crc`` is it continued over K and the codes, folded into the same pass, or None when C could not
        fold it (the caller computes it); without ``crc``, None. Raises :class:`~.base.Declined` for what
        C does not take (then nothing was written), and at NaN codes (then part of the outputs may be).
        """
        page = _page(groups)
        if isinstance(page, str):
            raise Declined(page)
        _declined(
            _out_refusal(out_v, _DECODE[1], out_v.shape) or _scales_refusal(scales, groups, out_v.shape, page)
        )
        if not out_k.is_contiguous() or out_k.numel() * out_k.element_size() != k_len or out_k.requires_grad:
            raise Declined("out_k is not a C-contiguous tensor of K's bytes")
        if k_done and crc is not None:
            raise Declined("a CRC over K's bytes needs K copied here")
        codes = np.frombuffer(payload, np.uint8, out_v.numel(), k_len).reshape(out_v.shape)
        args = [codes, _scales32(scales), _SCOPE[groups.scope], page, _buf(out_v), _DTYPE[out_v.dtype]]
        if not k_done:
            args += [np.frombuffer(payload, np.uint8, k_len), _buf(out_k).reshape(-1).view(np.uint8), crc]
        return _served(_cpu.dequantize(*args))

    def expand_dequant(self, scales: torch.Tensor, groups: Groups, out_v: torch.Tensor) -> ExpandDequant:
        """:meth:`decode_host`'s dequantization planned for :func:`lossless_expand` (``deq``), which
        dequantizes a lossless blob's codes in the call that expands them; raises :class:`~.base.Declined`
        where :meth:`decode_host` would decline before writing anything. The plan holds no tensor: it
        serves any scales and ``out_v`` alike in all that is checked here (a caller may keep it)."""
        page = _page(groups)
        if isinstance(page, str):
            raise Declined(page)
        _declined(
            _out_refusal(out_v, _DECODE[1], out_v.shape) or _scales_refusal(scales, groups, out_v.shape, page)
        )
        return ExpandDequant(_SCOPE[groups.scope], page, _DTYPE[out_v.dtype])

    # The cache lanes: the module's functions below (the vLLM connector's loads).

    def scatter_rows(self, src: torch.Tensor, cache: torch.Tensor, col: int, runs: np.ndarray) -> Served:
        """Copy ``src`` ``[T, H, D]`` rows into columns ``col .. col + D`` of a ``[N, H, S, C]`` cache view.

        ``runs`` rows are ``(block, first slot, first src token, tokens)``: token ``t + j`` goes to
        ``cache[block, :, slot + j, col : col + D]``. Raises :class:`~.base.Declined` with why C declined
        (nothing written; the caller copies another way). A run outside the view or ``src`` raises.
        """
        return _served(_scatter_rows(src, cache, col, runs))

    def scatter_blob_rows_many(
        self, writes: Sequence[tuple[BlobRows, torch.Tensor, int | None]], v_col: int, runs: np.ndarray
    ) -> list[Served | Declined]:
        """:func:`scatter_blob_rows` of each ``(rows, cache, crc)`` (a chunk's layers: one ``v_col``, the
        same ``runs``): the runs checked once and no Python frame per layer. Each result is that layer's
        :class:`~.base.Served`, or the :class:`~.base.Declined` it met (a value: the other layers go on)."""
        got = _scatter_blob_rows_many(writes, v_col, runs)
        return [Declined(g) if isinstance(g, str) else Served(g) for g in got]


BACKEND = CpuBackend()
"""The one instance the dispatcher uses."""


# ----------------------------------------------------------------------------
# Rows into a paged cache view (the vLLM connector's loads)
# ----------------------------------------------------------------------------


def _cache_refusal(cache: torch.Tensor, dtypes: object) -> str | None:
    """Why C cannot write the 4-D cache view (None when it can; C checks strides and overlaps)."""
    if type(cache) not in _PLAIN or cache.device.type != "cpu" or cache.layout != torch.strided:
        return "the cache is not a strided CPU tensor"
    if cache.dim() != 4 or cache.dtype not in dtypes or cache.requires_grad:  # type: ignore[operator]
        return f"the cache is not a 4-D {dtypes} view without grad"
    return None


def _runs(runs: np.ndarray) -> np.ndarray:
    if runs.dtype != np.int64 or runs.ndim != 2 or runs.shape[1] != 4:
        raise UnsupportedConfigError(
            f"runs must be an int64 [R, 4] array; got {runs.dtype} {runs.shape}", reason=Reason.BAD_VALUE
        )
    return np.ascontiguousarray(runs)


_ROW_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int16, torch.int32, torch.uint8)
"""Row dtypes :meth:`CpuBackend.scatter_rows` copies (bytes as they are)."""


def _scatter_rows(src: torch.Tensor, cache: torch.Tensor, col: int, runs: np.ndarray) -> str | None:
    """:meth:`CpuBackend.scatter_rows` as C answers: None when done, else why it declined."""
    if _cpu is None:
        return REASON
    why = _rows_refusal(src, _ROW_DTYPES, "src") or _cache_refusal(cache, (src.dtype,))
    if why is not None:
        return why
    return _cpu.scatter_rows(_buf(src), _buf(cache), col, _runs(runs))


def scatter_dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    groups: Groups,
    cache: torch.Tensor,
    col: int,
    runs: np.ndarray,
) -> Served:
    """:meth:`CpuBackend.dequantize` of the ``runs``' rows of ``codes`` straight into a cache view.

    As :meth:`CpuBackend.scatter_rows`, with ``float(code) * scale`` (the scale of the row's group, by
    its token in ``codes``) written in the cache's dtype, bit-exact with the reference. Raises
    :class:`~.base.Declined` with why C declined: then nothing is written (NaN codes, non-finite
    scales, a layout C does not take).
    """
    page = _page(groups)
    if isinstance(page, str):
        raise Declined(page)
    _declined(
        _rows_refusal(codes, _DECODE[0], "codes")
        or _scales_refusal(scales, groups, codes.shape, page)
        or _cache_refusal(cache, _DECODE[1])
    )
    got = _cpu.scatter_dequant(
        _buf(codes),
        _scales32(scales),
        _SCOPE[groups.scope],
        page,
        _buf(cache),
        col,
        _DTYPE[cache.dtype],
        _runs(runs),
    )
    return _served(got)


def scatter_blob_rows(
    rows: BlobRows, cache: torch.Tensor, v_col: int, runs: np.ndarray, *, crc: int | None = None
) -> Served:
    """A blob's K rows (to columns ``0 ..``) and V dequantized (to columns ``v_col ..``) into a
    ``[N, H, S, C]`` cache view of K's dtype, in one C pass over ``runs`` (see :meth:`CpuBackend.scatter_rows`).

    Bit-exact with :meth:`CpuBackend.dequantize` and a copy of K. Raises :class:`~.base.Declined`
    with why C declined, with nothing written (NaN codes, a layout C does not take). A run outside
    the view, or rows that do not fit it, raise.

    With ``crc`` (the CRC of the blob's header prefix: ``payload_crc(header, parsed.crc_prefix, ())``,
    0 for version 1) and ``rows`` the blob's own K and codes views, the result's ``crc`` is that CRC
    continued over all of K and the codes, folded into the same pass (a blob read without its CRC
    check is then checked here: continue it over the scale bytes and compare with the stored CRC;
    the cache has been written by then, so a mismatch must fail the load); None when C could not
    fold it (the caller checks the blob's CRC itself).
    """
    return _served(_scatter_blob_rows_many([(rows, cache, crc)], v_col, runs)[0])


def _scatter_blob_rows_many(
    writes: Sequence[tuple[BlobRows, torch.Tensor, int | None]], v_col: int, runs: np.ndarray
) -> list[str | int | None]:
    """:meth:`CpuBackend.scatter_blob_rows_many` as C answers: per layer its CRC or None when done,
    else why it declined."""
    runs = _runs(runs)
    out: list[str | int | None] = []
    for rows, cache, crc in writes:
        page = _page(rows.groups)
        why = page if isinstance(page, str) else _cache_refusal(cache, _DECODE[1])
        if why is not None:
            out.append(why)
            continue
        scope = _SCOPE[rows.groups.scope]
        cache_buf, dtype = _buf(cache), _DTYPE[cache.dtype]
        out.append(
            _cpu.scatter_dequant(
                rows.codes, rows.scales, scope, page, cache_buf, v_col, dtype, runs, rows.k, 0, crc
            )
        )
    return out

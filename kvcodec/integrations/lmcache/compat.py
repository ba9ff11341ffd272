"""Drop-in surface of LMCache's ``lmcache.v1.kv_codec`` (0.5.6), backed by kvcodec.

Names, signatures, defaults and error types follow LMCache so connector code
runs unchanged; the work is done by :mod:`kvcodec.format`, :mod:`kvcodec.backends`
and :mod:`kvcodec.codec`. Differences are deliberate fixes: decode restores
``[tokens, heads, head_dim]`` shapes when the header carries the layout and
dequantizes every scope; the parser refuses malformed blobs LMCache accepts;
V is quantized by kvcodec's backends (the C loops on CPU, Triton on CUDA),
chosen and fallen back from in :mod:`kvcodec.backends` only.

Errors: everything this module raises on purpose is a :class:`CodecError`
subclass under LMCache's names. Where LMCache lets a plain exception escape
(``AttributeError`` for a list in place of a tensor, ``RuntimeError`` for a bad
``device`` or a scale count that does not fit, ``ValueError`` for an unknown
scope number), this module raises :class:`UnsupportedConfigError` instead, and
it checks the codec's scope and scale dtype when the codec is built, not at its
first encode. One deliberate difference in what is accepted: a header is never
written whose layout fields would make kvcodec's decoder dequantize V under
groups other than those V was quantized in (a PER_PAGE_HEAD ``page_size`` other
than the page axis's length; ``kv_head_count``/``head_dim`` that do not describe
a caller layout's bytes), so those encodes raise UnsupportedConfigError. NaN or
Inf in V is refused in every layout, as kvcodec's own encode does.

``install()`` registers this module as ``lmcache.v1.kv_codec`` (and its
``encoded_kv``, ``errors`` and ``asym_k16_v8`` submodules) in ``sys.modules``.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar

import torch

from ... import backends
from ...backends import reference as _ref
from ...codec import DecodeRequest, EncodeSpec, check_hashes, decode_parsed, plan_encode
from ...codec.dtypes import KDTYPES, SCALE_DTYPES, to_torch
from ...codec.encode import seal, write_payload
from ...errors import CodecError, CodecMismatchError, CorruptEncodedKVError, Reason, UnsupportedConfigError
from ...format import (
    FIXED_HEADER_LEN,
    FLOAT8_DTYPES,
    MAGIC,
    Hashes,
    Header,
    ParsedBlob,
    ScaleScope,
    as_bytes_view,
    check_consistency,
    check_stored_scales,
    header_size,
    parse,
)
from ...format import assemble as _assemble
from ...format import serialize_header as _serialize_header
from ...hostmem import filled_bytes
from ...numerics import FP8_DTYPES, amax_to_scale, fp8_max, scale_shape

__all__ = [
    "CODEC_MAGIC",
    "CODEC_MAGIC_LEN",
    "AsymK16V8Codec",
    "CodecError",
    "CodecHashes",
    "CodecMismatchError",
    "CodecVersion",
    "CorruptEncodedKVError",
    "EncodedKV",
    "ScaleScheme",
    "ScaleScope",
    "UnsupportedConfigError",
    "compute_v_scales",
    "dequantize_v_fp8",
    "deserialize_header",
    "encoded_kv_header_size",
    "install",
    "quantize_v_fp8",
    "serialize_header",
]

CODEC_MAGIC: bytes = MAGIC
CODEC_MAGIC_LEN: int = len(CODEC_MAGIC)
_FIXED_HEADER_LEN: int = FIXED_HEADER_LEN
_ZERO_SCALE_SENTINEL = 1.0


class CodecVersion(IntEnum):
    """Header versions: 1 (payload CRC) and 2 (header+payload CRC, scale scheme)."""

    V1 = 1
    V2 = 2


class ScaleScheme(IntEnum):
    """LMCache's names for the header's scale-scheme slot (kvcodec's ``COMPUTED``/``UNIT`` are aliases)."""

    COMPUTED_PER_TENSOR = 0
    """Scales computed from V and stored (every v1 blob)."""
    RAW_UNIT = 1
    """Raw FP8 at unit scale, no scales (needs header version 2)."""
    COMPUTED = 0
    UNIT = 1


@dataclass
class CodecHashes:
    """Identity hashes gating cross-config cache poisoning ("" = not provided)."""

    model_id: str = ""
    model_revision_hash: str = ""
    tokenizer_hash: str = ""
    rope_config_hash: str = ""
    attention_backend: str = ""
    kv_layout: str = ""

    _CHECK_ORDER: ClassVar[tuple[str, ...]] = (
        "model_id",
        "model_revision_hash",
        "tokenizer_hash",
        "rope_config_hash",
        "attention_backend",
        "kv_layout",
    )


@dataclass
class EncodedKV:
    """LMCache's mutable blob record: header fields plus ``payload`` (K ‖ V ‖ scales)."""

    k_dtype: torch.dtype
    v_dtype: torch.dtype
    scale_dtype: torch.dtype = torch.float32
    scale_scope: ScaleScope = ScaleScope.PER_PAGE_HEAD
    hashes: CodecHashes = field(default_factory=CodecHashes)
    layer_id: int = -1
    chunk_id: int = -1
    chunk_size: int = -1
    page_size: int = -1
    kv_head_count: int = -1
    head_dim: int = -1
    scale_shape: tuple[int, ...] = ()
    k_payload_len: int = 0
    v_payload_len: int = 0
    scale_payload_len: int = 0
    payload: bytes | memoryview = b""
    header_bytes: bytes | None = None
    version: int = 1
    scale_scheme: ScaleScheme = ScaleScheme.COMPUTED_PER_TENSOR
    # (blob kvcodec built or parsed, the payload view it handed out, its Header),
    # so to_bytes copies once and decode reuses the header.
    _blob: Any = field(default=None, repr=False, compare=False)

    @property
    def total_bytes(self) -> int:
        """Header + payload bytes (-1 before the header is serialized)."""
        if self.header_bytes is None:
            return -1
        return len(as_bytes_view(self.header_bytes)) + len(_payload(self))

    def expected_payload_len(self) -> int:
        """K + V + scale lengths as declared."""
        return self.k_payload_len + self.v_payload_len + self.scale_payload_len


# ----------------------------------------------------------------------------
# LMCache's error phrases, chosen by the error's reason
# ----------------------------------------------------------------------------

_LMCACHE_PHRASES: dict[Reason, str] = {
    Reason.UNKNOWN_DTYPE_ID: "unknown dtype index",
    Reason.NO_DTYPE_ID: "unknown dtype: not in protocol DTYPE_TO_INT mapping",
    Reason.UNSUPPORTED_VERSION: "unsupported codec version",
    Reason.RESERVED_NONZERO: "nonzero reserved/scale_scheme slot",
    Reason.UNKNOWN_SCHEME: "unknown scale_scheme",
    Reason.UNKNOWN_SCOPE_ID: "unknown scale_scope index",
    Reason.NEGATIVE_PAYLOAD_LEN: "negative payload length",
    Reason.TRUNCATED_PAYLOAD: "buffer truncated mid-payload",
    Reason.SCALE_RANK_OUT_OF_RANGE: "implausible scale_shape_n",
    Reason.CRC_MISMATCH: "payload CRC mismatch",
}
"""The phrase LMCache 0.5.6 raises for the same failure, for callers that match on it."""


def _lmcache_error(e: CodecError) -> CodecError:
    """``e`` (same class and reason) with LMCache's phrase for its reason in front, if LMCache has one."""
    phrase = _LMCACHE_PHRASES.get(e.reason)
    return e if phrase is None else type(e)(f"{phrase}: {e}", reason=e.reason)


# ----------------------------------------------------------------------------
# Header functions
# ----------------------------------------------------------------------------


def _version(enc: EncodedKV) -> int:
    """LMCache writes RAW_UNIT blobs as version 2 whatever ``enc.version`` says."""
    return max(int(enc.version), 2) if int(enc.scale_scheme) == ScaleScheme.RAW_UNIT else int(enc.version)


def _to_header(enc: EncodedKV) -> Header:
    try:
        return Header(
            k_dtype=enc.k_dtype,
            v_dtype=enc.v_dtype,
            scale_dtype=enc.scale_dtype,
            scale_scope=ScaleScope(enc.scale_scope),
            version=_version(enc),
            scale_scheme=int(enc.scale_scheme),
            layer_id=enc.layer_id,
            chunk_id=enc.chunk_id,
            chunk_size=enc.chunk_size,
            page_size=enc.page_size,
            kv_head_count=enc.kv_head_count,
            head_dim=enc.head_dim,
            scale_shape=tuple(int(d) for d in enc.scale_shape),
            k_payload_len=enc.k_payload_len,
            v_payload_len=enc.v_payload_len,
            scale_payload_len=enc.scale_payload_len,
            hashes=Hashes.coerce(enc.hashes),
        )
    except UnsupportedConfigError as e:
        raise _lmcache_error(e) from None


def _header_of(enc: EncodedKV) -> Header:
    """The Header kvcodec built or parsed for ``enc`` (reused while untouched), else one from its fields."""
    if enc._blob is not None:
        h = enc._blob[2]
        if (
            enc.k_payload_len == h.k_payload_len
            and enc.v_payload_len == h.v_payload_len
            and enc.scale_payload_len == h.scale_payload_len
            and enc.layer_id == h.layer_id
            and enc.chunk_size == h.chunk_size
            and enc.kv_head_count == h.kv_head_count
            and enc.head_dim == h.head_dim
            and enc.page_size == h.page_size
            and tuple(enc.scale_shape) == h.scale_shape
            and int(enc.scale_scope) == h.scale_scope
        ):
            return h
    return _to_header(enc)


def _from_parsed(p: ParsedBlob, hashes: CodecHashes | None = None) -> EncodedKV:
    h = p.header
    payload = p.payload
    return EncodedKV(
        k_dtype=to_torch(h.k_dtype),
        v_dtype=to_torch(h.v_dtype),
        scale_dtype=to_torch(h.scale_dtype),
        scale_scope=h.scale_scope,
        hashes=hashes if hashes is not None else CodecHashes(**h.hashes.as_dict()),
        layer_id=h.layer_id,
        chunk_id=h.chunk_id,
        chunk_size=h.chunk_size,
        page_size=h.page_size,
        kv_head_count=h.kv_head_count,
        head_dim=h.head_dim,
        scale_shape=h.scale_shape,
        k_payload_len=h.k_payload_len,
        v_payload_len=h.v_payload_len,
        scale_payload_len=h.scale_payload_len,
        payload=payload,
        header_bytes=bytes(p.header_bytes),
        version=h.version,
        scale_scheme=ScaleScheme(int(h.scale_scheme)),
        _blob=(p.blob, payload, h),
    )


def encoded_kv_header_size(enc: EncodedKV) -> int:
    """Serialized header size of ``enc`` in bytes (payload excluded)."""
    _check_enc(enc)
    return header_size(_to_header(enc))


def serialize_header(enc: EncodedKV) -> bytes:
    """Header bytes of ``enc`` with the CRC of ``enc.payload`` (lengths must match)."""
    _check_enc(enc)
    lens = (enc.k_payload_len, enc.v_payload_len, enc.scale_payload_len)
    if any(n < 0 for n in lens):
        raise UnsupportedConfigError(
            f"payload lengths must be non-negative; got K, V, scales = {lens}",
            reason=Reason.NEGATIVE_PAYLOAD_LEN,
        )
    payload = _payload(enc)
    if len(payload) != enc.expected_payload_len():
        raise UnsupportedConfigError(
            f"payload length {len(payload)} does not match "
            f"declared K({enc.k_payload_len}) + V({enc.v_payload_len}) "
            f"+ scales({enc.scale_payload_len})",
            reason=Reason.INCONSISTENT_PAYLOAD,
        )
    return _serialize_header(_to_header(enc), [payload])


def _parse(buf: Any, *, header_level: bool) -> ParsedBlob:
    """kvcodec's parse with LMCache's phrases; ``header_level`` skips only the K/V/scale consistency step."""
    try:
        return parse(buf, consistency=not header_level)
    except CodecError as e:
        raise _lmcache_error(e) from None


def deserialize_header(buf: Any) -> EncodedKV:
    """Parse a blob (header + payload) into an EncodedKV whose payload views ``buf``.

    Header-level, as LMCache's: structure, bounds and the CRC are checked here;
    whether K, V and scale lengths describe one tensor is checked by decode.
    """
    return _from_parsed(_parse(buf, header_level=True))


# ----------------------------------------------------------------------------
# Quant primitives with LMCache's layout-agnostic signatures
# ----------------------------------------------------------------------------


def _fp8_max(dtype: torch.dtype) -> float:
    if dtype not in FP8_DTYPES:
        raise UnsupportedConfigError(
            f"compute_v_scales: dtype {dtype} is not an FP8 dtype", reason=Reason.UNSUPPORTED_DTYPE
        )
    return fp8_max(dtype)


def _tensor(x: Any, what: str) -> torch.Tensor:
    """``x`` itself when it is a tensor (LMCache would fail on it with an AttributeError)."""
    if not isinstance(x, torch.Tensor):
        raise UnsupportedConfigError(
            f"{what} must be a torch.Tensor; got {type(x).__name__}", reason=Reason.BAD_TYPE
        )
    return x


def _dtype(x: Any, what: str) -> torch.dtype:
    if not isinstance(x, torch.dtype):
        raise UnsupportedConfigError(f"{what} must be a torch.dtype; got {x!r}", reason=Reason.BAD_TYPE)
    return x


def _device(device: Any) -> torch.device:
    """LMCache's ``device or cpu``, a bad device named as a config error."""
    try:
        return torch.device(device) if device is not None else torch.device("cpu")
    except (RuntimeError, TypeError, ValueError) as e:
        raise UnsupportedConfigError(
            f"decode: bad device {device!r}: {e}", reason=Reason.BAD_DEVICE
        ) from None


_LMCACHE_SCOPES = (
    ScaleScope.PER_TENSOR,
    ScaleScope.PER_LAYER_HEAD,
    ScaleScope.PER_PAGE_HEAD,
    ScaleScope.EXTERNAL,
)


def _lm_scope(scope: Any, what: str = "scope") -> ScaleScope:
    """One of LMCache's four scopes (an enum member or its value)."""
    if (
        isinstance(scope, bool)
        or not isinstance(scope, int)
        or scope not in {int(s) for s in _LMCACHE_SCOPES}
    ):
        raise UnsupportedConfigError(
            f"unsupported {what}: {scope!r}; expected one of {[s.name for s in _LMCACHE_SCOPES]}",
            reason=Reason.BAD_SCOPE,
        )
    return ScaleScope(scope)


def _axis(axis: Any, nd: int, what: str) -> int:
    """``axis`` of an ``nd``-D tensor as a non-negative index."""
    if isinstance(axis, bool) or not isinstance(axis, int) or not -nd <= axis < nd:
        raise UnsupportedConfigError(
            f"{what}={axis!r} is not an axis of a {nd}-D tensor", reason=Reason.BAD_VALUE
        )
    return axis % nd


def _canon(
    x: Any, scope: Any, head_axis: Any, page_axis: Any, who: str
) -> tuple[torch.Tensor, ScaleScope, int | None, tuple[int, ...], list[int]]:
    """View ``x`` as kvcodec's [tokens, heads, dim] such that LMCache's groups map onto ours.

    Returns the 3-D tensor, the scope, the page size to use (one page per
    index of LMCache's page axis), the moved shape and the permutation to undo.
    """
    x = _tensor(x, f"{who}: the tensor").detach()
    scope = _lm_scope(scope)
    nd = x.dim()
    if scope == ScaleScope.PER_TENSOR:
        return x.reshape(1, 1, -1), scope, None, tuple(x.shape), list(range(nd))
    if scope == ScaleScope.EXTERNAL:
        raise UnsupportedConfigError(f"{who}: unsupported scope: {scope}", reason=Reason.BAD_SCOPE)
    if nd == 0:
        raise UnsupportedConfigError(
            f"{who}({scope.name}) needs a tensor with a head axis; got a 0-D one", reason=Reason.BAD_SHAPE
        )
    head = _axis(head_axis, nd, "head_axis")
    if scope == ScaleScope.PER_LAYER_HEAD:
        order = [head] + [d for d in range(nd) if d != head]
        y = x.permute(order)
        return y.reshape(1, x.shape[head], -1), scope, None, tuple(y.shape), order
    if page_axis is None:
        raise UnsupportedConfigError(
            f"{who}(PER_PAGE_HEAD) requires page_axis", reason=Reason.MISSING_ARGUMENT
        )
    page = _axis(page_axis, nd, "page_axis")
    if page == head:
        raise UnsupportedConfigError(
            f"{who}(PER_PAGE_HEAD): page_axis and head_axis are the same axis ({page})",
            reason=Reason.BAD_VALUE,
        )
    order = [page, head] + [d for d in range(nd) if d not in (page, head)]
    y = x.permute(order)
    return y.reshape(x.shape[page], x.shape[head], -1), scope, 1, tuple(y.shape), order


def _uncanon(y3: torch.Tensor, moved: tuple[int, ...], order: list[int]) -> torch.Tensor:
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return y3.reshape(moved).permute(inv).contiguous()


def _scales_for(
    scales: Any, x3: torch.Tensor, scope: ScaleScope, page_size: int | None, who: str
) -> torch.Tensor:
    """The caller's scales shaped as kvcodec's for the canonical ``x3``, on its device."""
    s = _tensor(scales, f"{who}: scales")
    shape = scale_shape(scope, x3.shape[0], x3.shape[1], page_size)
    if s.numel() != math.prod(shape):
        raise UnsupportedConfigError(
            f"{who}: {s.numel()} scales given; {scope.name} over this tensor has {math.prod(shape)} {shape}",
            reason=Reason.BAD_SCALES,
        )
    return s.detach().to(x3.device).reshape(shape)


def _dispatch(
    op: str, x3: torch.Tensor, scales: torch.Tensor, groups: backends.Groups, out_dtype: torch.dtype
) -> torch.Tensor:
    """``op`` (quantize / dequantize) by the backend kvcodec picks for ``x3``'s device."""
    out = torch.empty(x3.shape, dtype=out_dtype, device=x3.device)
    if x3.numel() == 0:
        return out
    return backends.call(backends.select(None, x3.device), op, x3, scales, groups, out=out)


def compute_v_scales(
    v: torch.Tensor,
    scope: ScaleScope,
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    head_axis: int = -2,
    page_axis: int | None = None,
) -> torch.Tensor:
    """fp32 scales of ``v``: () per tensor, (heads,) per layer-head, (pages, heads) per page-head."""
    qmax = _fp8_max(fp8_dtype)
    if scope == ScaleScope.EXTERNAL:
        raise UnsupportedConfigError(
            "compute_v_scales does not produce EXTERNAL scales; the caller is expected to attach them.",
            reason=Reason.BAD_SCOPE,
        )
    v3, sc, ps, _, _ = _canon(v, scope, head_axis, page_axis, "compute_v_scales")
    # Quietly like LMCache: NaN/Inf groups give whatever the formula gives. Torch
    # reductions only (no backend computes scales without also quantizing).
    s = amax_to_scale(_ref.reduce_groups(_ref.token_head_amax(v3), sc, ps), qmax)
    return s.reshape(()) if sc == ScaleScope.PER_TENSOR else s


def quantize_v_fp8(
    v: torch.Tensor,
    scales: torch.Tensor,
    scope: ScaleScope,
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    head_axis: int = -2,
    page_axis: int | None = None,
) -> torch.Tensor:
    """FP8 of ``v`` under ``scales`` (saturating), same shape as ``v``."""
    _fp8_max(fp8_dtype)
    v3, sc, ps, moved, order = _canon(v, scope, head_axis, page_axis, "quantize_v_fp8")
    s = _scales_for(scales, v3, sc, ps, "quantize_v_fp8")
    return _uncanon(_dispatch("quantize", v3, s, backends.Groups(sc, ps, fp8_dtype), fp8_dtype), moved, order)


def dequantize_v_fp8(
    q: torch.Tensor,
    scales: torch.Tensor,
    scope: ScaleScope,
    *,
    out_dtype: torch.dtype = torch.float16,
    head_axis: int = -2,
    page_axis: int | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize_v_fp8`, in ``out_dtype``."""
    out_dtype = _dtype(out_dtype, "dequantize_v_fp8: out_dtype")
    q3, sc, ps, moved, order = _canon(q, scope, head_axis, page_axis, "dequantize_v_fp8")
    if q3.dtype not in FP8_DTYPES:
        raise UnsupportedConfigError(
            f"dequantize_v_fp8: codes must be an FP8 dtype; got {q3.dtype}", reason=Reason.UNSUPPORTED_DTYPE
        )
    s = _scales_for(scales, q3, sc, ps, "dequantize_v_fp8")
    return _uncanon(
        _dispatch("dequantize", q3, s, backends.Groups(sc, ps, q3.dtype), out_dtype), moved, order
    )


# ----------------------------------------------------------------------------
# The codec class
# ----------------------------------------------------------------------------

_LAYOUT_FIELDS = ("chunk_size", "page_size", "kv_head_count", "head_dim")


class AsymK16V8Codec:
    """LMCache's FP16/BF16-K + FP8-V codec, implemented by kvcodec.

    Stateless apart from configuration; default scope is PER_TENSOR as in
    LMCache. float8_e5m2 is refused here as LMCache does (kvcodec's own API
    offers it as an opt-in).
    """

    def __init__(
        self,
        *,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        scale_dtype: torch.dtype = torch.float32,
        scale_scope: ScaleScope = ScaleScope.PER_TENSOR,
    ):
        if fp8_dtype not in FP8_DTYPES:
            raise UnsupportedConfigError(
                f"AsymK16V8Codec: fp8_dtype must be float8_e4m3fn (or e5m2 reserved); got {fp8_dtype}",
                reason=Reason.UNSUPPORTED_DTYPE,
            )
        if fp8_dtype == torch.float8_e5m2:
            raise UnsupportedConfigError(
                "float8_e5m2 is reserved-but-not-implemented in v1; use float8_e4m3fn",
                reason=Reason.UNSUPPORTED_DTYPE,
            )
        if scale_dtype not in SCALE_DTYPES:
            raise UnsupportedConfigError(
                f"AsymK16V8Codec: scale_dtype must be one of {[str(d) for d in SCALE_DTYPES]}; got {scale_dtype!r}",
                reason=Reason.UNSUPPORTED_DTYPE,
            )
        self.fp8_dtype = fp8_dtype
        self.scale_dtype = scale_dtype
        self.scale_scope = _lm_scope(scale_scope, "AsymK16V8Codec scale_scope")

    def encode(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        hashes: CodecHashes | None = None,
        layer_id: int = -1,
        chunk_id: int = -1,
        chunk_size: int = -1,
        page_size: int = -1,
        kv_head_count: int = -1,
        head_dim: int = -1,
        head_axis: int = -2,
        page_axis: int | None = None,
        precomputed_v_scales: torch.Tensor | None = None,
        precomputed_v_quant: torch.Tensor | None = None,
    ) -> EncodedKV:
        """Encode (K, V) into an EncodedKV; unset layout fields are filled from the tensors."""
        k, v = _tensor(k, "encode: K"), _tensor(v, "encode: V")
        if k.shape != v.shape:
            raise UnsupportedConfigError(
                f"encode: K and V shapes must match; got K={tuple(k.shape)} vs V={tuple(v.shape)}",
                reason=Reason.BAD_SHAPE,
            )
        if v.dim() > 0:
            _axis(head_axis, v.dim(), "head_axis")
            if page_axis is not None:
                _axis(page_axis, v.dim(), "page_axis")
        scope = _lm_scope(self.scale_scope, "AsymK16V8Codec scale_scope")
        if precomputed_v_quant is not None and precomputed_v_scales is None:
            raise UnsupportedConfigError(
                "encode: precomputed_v_quant requires precomputed_v_scales", reason=Reason.MISSING_ARGUMENT
            )
        if precomputed_v_quant is None and scope == ScaleScope.EXTERNAL:
            raise UnsupportedConfigError(
                "compute_v_scales does not produce EXTERNAL scales; the caller is expected to attach them.",
                reason=Reason.BAD_SCOPE,
            )
        if scope == ScaleScope.PER_PAGE_HEAD and page_axis is None:
            raise UnsupportedConfigError(
                "compute_v_scales(PER_PAGE_HEAD) requires page_axis", reason=Reason.MISSING_ARGUMENT
            )
        given = {
            "chunk_size": chunk_size,
            "page_size": page_size,
            "kv_head_count": kv_head_count,
            "head_dim": head_dim,
        }
        pp_axis = page_axis if scope == ScaleScope.PER_PAGE_HEAD else None
        if not _token_major(v, head_axis, pp_axis):
            return self._encode_caller_layout(
                k,
                v,
                scope,
                hashes,
                layer_id,
                chunk_id,
                given,
                head_axis,
                page_axis,
                precomputed_v_scales,
                precomputed_v_quant,
            )
        spec = EncodeSpec(
            scope=scope,
            head_axis=head_axis,
            page_axis=pp_axis,
            hashes=hashes,
            layer_id=layer_id,
            chunk_id=chunk_id,
            v_dtype=self.fp8_dtype,
            scale_dtype=self.scale_dtype,
            version=1,
            precomputed_v_quant=precomputed_v_quant,
            precomputed_v_scales=precomputed_v_scales,
            # LMCache stores attached scales whatever the scope.
            store_scales=True if precomputed_v_quant is not None else None,
        )
        return _encode_once(k, v, spec, {n: val for n, val in given.items() if val != -1})

    def _encode_caller_layout(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        scope: ScaleScope,
        hashes: CodecHashes | None,
        layer_id: int,
        chunk_id: int,
        given: dict[str, int],
        head_axis: int,
        page_axis: int | None,
        pre_scales: torch.Tensor | None,
        pre_quant: torch.Tensor | None,
    ) -> EncodedKV:
        """LMCache's own semantics for layouts that are not token-major: bytes in the caller's
        layout (``.contiguous()``), layout fields only as given, so a caller's reshape to its
        shape restores the data exactly as with LMCache."""
        _check_caller_fields(v, scope, head_axis, page_axis, given)
        if pre_quant is not None:
            if _tensor(pre_quant, "encode: precomputed_v_quant").dtype != self.fp8_dtype:
                raise UnsupportedConfigError(
                    f"encode: precomputed_v_quant dtype {pre_quant.dtype} != codec {self.fp8_dtype}",
                    reason=Reason.UNSUPPORTED_DTYPE,
                )
            q, scales = pre_quant, _tensor(pre_scales, "encode: precomputed_v_scales").to(self.scale_dtype)
        else:
            q, scales = self._quantize_caller_layout(v, scope, head_axis, page_axis)
        if k.dtype not in KDTYPES:
            raise UnsupportedConfigError(
                f"K dtype must be float16, bfloat16 or float32; got {k.dtype}",
                reason=Reason.UNSUPPORTED_DTYPE,
            )
        parts = [t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy() for t in (k, q, scales)]
        h = Header(
            k_dtype=k.dtype,
            v_dtype=self.fp8_dtype,
            scale_dtype=self.scale_dtype,
            scale_scope=scope,
            layer_id=layer_id,
            chunk_id=chunk_id,
            scale_shape=tuple(scales.shape),
            hashes=Hashes.coerce(hashes),
            **given,
        )
        return _from_parsed(_parse_own(_assemble(h, *parts)), hashes)

    def _quantize_caller_layout(
        self, v: torch.Tensor, scope: ScaleScope, head_axis: int, page_axis: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 codes of ``v`` in its own layout and their scales, by one backend ``encode_v`` call."""
        v3, sc, ps, moved, order = _canon(v, scope, head_axis, page_axis, "encode")
        q3 = torch.empty(v3.shape, dtype=self.fp8_dtype, device=v3.device)
        if v3.numel() == 0:
            scales = compute_v_scales(
                v, scope, fp8_dtype=self.fp8_dtype, head_axis=head_axis, page_axis=page_axis
            )
            return _uncanon(q3, moved, order), scales.to(self.scale_dtype)
        groups = backends.Groups(sc, ps, self.fp8_dtype)
        be = backends.select(None, v3.device)
        scales = backends.call(
            be, "encode_v", v3, groups, scale_dtype=self.scale_dtype, nonfinite="error", out=q3
        )
        return _uncanon(q3, moved, order), scales.reshape(()) if sc == ScaleScope.PER_TENSOR else scales

    def to_bytes(self, enc: EncodedKV) -> bytes:
        """Header + payload as ``bytes``."""
        _check_enc(enc)
        if enc.header_bytes is None:
            enc.header_bytes = serialize_header(enc)
        if enc._blob is not None:
            blob, payload, _ = enc._blob
            hs = len(enc.header_bytes)
            # One copy of the blob as built, unless the caller swapped payload or header.
            if enc.payload is payload and blob[:hs] == enc.header_bytes:
                return blob if type(blob) is bytes else bytes(blob)
        return bytes(enc.header_bytes) + bytes(_payload(enc))

    def from_bytes(self, buf: Any, *, expected_hashes: CodecHashes | None = None) -> EncodedKV:
        """Parse a blob; a non-empty hash mismatch raises CodecMismatchError."""
        enc = deserialize_header(buf)
        if expected_hashes is not None:
            self._check_hash_match(enc.hashes, expected_hashes)
        return enc

    @staticmethod
    def _check_hash_match(got: CodecHashes, expected: CodecHashes) -> None:
        check_hashes(Hashes.coerce(got), expected)

    def decode(
        self,
        enc: EncodedKV,
        *,
        out_k_dtype: torch.dtype | None = None,
        out_v_dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K, V raw or dequantized, scales); shaped [tokens, heads, head_dim] when the header says."""
        _check_enc(enc)
        for name, dt in (("out_k_dtype", out_k_dtype), ("out_v_dtype", out_v_dtype)):
            if dt is not None:
                _dtype(dt, f"decode: {name}")
        dev = _device(device)
        if out_v_dtype is not None and out_v_dtype != enc.v_dtype and not out_v_dtype.is_floating_point:
            raise UnsupportedConfigError(
                f"decode: out_v_dtype {out_v_dtype} is not floating-point", reason=Reason.UNSUPPORTED_DTYPE
            )
        h = _header_of(enc)
        payload = _payload(enc)
        if len(payload) < h.payload_len:
            raise CorruptEncodedKVError(
                f"buffer truncated mid-payload: payload is {len(payload)} bytes; the header declares {h.payload_len}",
                reason=Reason.TRUNCATED_PAYLOAD,
            )
        _check_decodable(h, payload)
        req = DecodeRequest(
            device=dev,
            out_v_dtype=None if out_v_dtype in (None, enc.v_dtype) else out_v_dtype,
            copy=True,
        )
        # Without layout fields (LMCache's default) K and V come back flat, as from LMCache.
        res = decode_parsed(h, payload, req)
        k = res.k if res.k is not None else torch.empty(0, dtype=enc.k_dtype)
        if out_k_dtype is not None and out_k_dtype != k.dtype:
            k = k.to(out_k_dtype)
        scales = res.scales if res.scales is not None else torch.empty(0, dtype=enc.scale_dtype)
        return k, res.v, scales


def _check_decodable(h: Header, payload: memoryview) -> None:
    """What deserialize_header leaves to decode (kvcodec's parser's final steps): K, V and scale
    lengths that describe one tensor, and stored scales encode could have written (finite, > 0)."""
    if h.v_dtype not in FLOAT8_DTYPES:
        raise UnsupportedConfigError(
            f"decode: blob's V dtype {h.v_dtype} is not FP8; this codec writes FP8 V",
            reason=Reason.UNSUPPORTED_DTYPE,
        )
    try:
        check_consistency(h)
    except CorruptEncodedKVError as e:
        raise _lmcache_error(e) from None
    scales_at = h.k_payload_len + h.v_payload_len
    check_stored_scales(h, payload[scales_at : scales_at + h.scale_payload_len])


def _encode_once(k: torch.Tensor, v: torch.Tensor, spec: EncodeSpec, fields: dict[str, int]) -> EncodedKV:
    """One encode pass: plan with kvcodec, apply the caller's layout fields to the header, write, seal once."""
    plan = plan_encode(k, v, spec)
    given_ps = fields.get("page_size", plan.groups.page_size)
    if plan.header.scale_scope == ScaleScope.PER_PAGE_HEAD and given_ps != plan.groups.page_size:
        raise UnsupportedConfigError(
            f"encode: page_size={given_ps} but V's pages (page_axis) hold {plan.groups.page_size} tokens, "
            "and PER_PAGE_HEAD scales are read by that page size",
            reason=Reason.BAD_VALUE,
        )
    if fields:
        plan.header = plan.header.replace(**fields)
        _check_fields(plan.header)
    h = plan.header
    hs = header_size(h)

    def fill(mv: memoryview) -> None:
        if plan.v.device.type == "cpu":
            write_payload(plan, mv[hs:])  # host memory: the cpu backend's one-call lane, as kvcodec.encode
        else:
            dev = torch.empty(h.payload_len, dtype=torch.uint8, device=plan.v.device)
            write_payload(plan, dev)
            torch.frombuffer(mv[hs:], dtype=torch.uint8).copy_(dev)
        seal(mv, h)

    blob = filled_bytes(hs + h.payload_len, fill)  # LMCache hands out bytes: built as bytes, no final copy
    mv = memoryview(blob)
    pv = mv[hs:]
    return EncodedKV(
        k_dtype=k.dtype,
        v_dtype=spec.v_dtype,
        scale_dtype=spec.scale_dtype,
        scale_scope=h.scale_scope,
        hashes=spec.hashes if isinstance(spec.hashes, CodecHashes) else CodecHashes(**h.hashes.as_dict()),
        layer_id=h.layer_id,
        chunk_id=h.chunk_id,
        chunk_size=h.chunk_size,
        page_size=h.page_size,
        kv_head_count=h.kv_head_count,
        head_dim=h.head_dim,
        scale_shape=h.scale_shape,
        k_payload_len=h.k_payload_len,
        v_payload_len=h.v_payload_len,
        scale_payload_len=h.scale_payload_len,
        payload=pv,
        header_bytes=bytes(mv[:hs]),
        version=1,
        _blob=(blob, pv, h),
    )


def _check_fields(h: Header) -> None:
    """Caller layout fields must still describe the tensors (kvcodec's parser would refuse the blob)."""
    try:
        check_consistency(h)
    except CorruptEncodedKVError as e:
        raise UnsupportedConfigError(
            f"the layout fields given make an inconsistent blob: {e}", reason=Reason.INCONSISTENT_PAYLOAD
        ) from None


_INT_FIELDS = (
    "layer_id",
    "chunk_id",
    "chunk_size",
    "page_size",
    "kv_head_count",
    "head_dim",
    "k_payload_len",
    "v_payload_len",
    "scale_payload_len",
    "version",
)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_enc(enc: Any) -> None:
    """Refuse an EncodedKV whose fields a caller set to something no header holds (LMCache lets
    ValueError/TypeError escape from these), so everything below may trust the field types."""
    if not isinstance(enc, EncodedKV):
        raise UnsupportedConfigError(
            f"expected an EncodedKV; got {type(enc).__name__}", reason=Reason.BAD_TYPE
        )
    for name in _INT_FIELDS:
        if not _is_int(getattr(enc, name)):
            raise UnsupportedConfigError(
                f"EncodedKV.{name} must be an int; got {getattr(enc, name)!r}", reason=Reason.BAD_TYPE
            )
    if not _is_int(enc.scale_scope) or enc.scale_scope not in {int(s) for s in ScaleScope}:
        raise UnsupportedConfigError(
            f"EncodedKV.scale_scope {enc.scale_scope!r} unknown; expected one of {[s.name for s in ScaleScope]}",
            reason=Reason.BAD_SCOPE,
        )
    if not _is_int(enc.scale_scheme) or enc.scale_scheme not in {int(s) for s in ScaleScheme}:
        raise UnsupportedConfigError(
            f"EncodedKV.scale_scheme {enc.scale_scheme!r} unknown; expected 0 or 1", reason=Reason.BAD_VALUE
        )
    if not isinstance(enc.scale_shape, (tuple, list)) or not all(_is_int(d) for d in enc.scale_shape):
        raise UnsupportedConfigError(
            f"EncodedKV.scale_shape must be a tuple of ints; got {enc.scale_shape!r}", reason=Reason.BAD_SHAPE
        )
    _payload(enc)
    if enc.header_bytes is not None and not isinstance(enc.header_bytes, (bytes, bytearray, memoryview)):
        raise UnsupportedConfigError(
            f"EncodedKV.header_bytes must be bytes or None; got {type(enc.header_bytes).__name__}",
            reason=Reason.BAD_TYPE,
        )


def _payload(enc: EncodedKV) -> memoryview:
    """``enc.payload`` as contiguous bytes: LMCache's type is bytes or a memoryview, never a tensor."""
    if isinstance(enc.payload, torch.Tensor) or enc.payload is None:
        raise UnsupportedConfigError(
            f"EncodedKV.payload must be bytes or a memoryview; got {type(enc.payload).__name__}",
            reason=Reason.BAD_BUFFER,
        )
    return as_bytes_view(enc.payload)


def _caller_reading(v: torch.Tensor, scope: ScaleScope, head: int, page: int | None) -> dict[str, int] | None:
    """The layout fields under which kvcodec's decoder, reading ``v``'s contiguous bytes as
    token-major ``[tokens, heads, head_dim]``, finds V's scale groups (None: no such fields).

    Axes before the head axis are tokens, axes after it head_dim; per page-head,
    the page axis must lead and the axes between it and the head are the page's tokens.
    """
    shape = tuple(v.shape)
    fields = {"kv_head_count": shape[head], "head_dim": math.prod(shape[head + 1 :])}
    if scope == ScaleScope.PER_PAGE_HEAD:
        if page != 0 or head <= page:
            return None
        fields["page_size"] = math.prod(shape[1:head])
    return fields


def _check_caller_fields(
    v: torch.Tensor, scope: ScaleScope, head_axis: int, page_axis: int | None, given: dict[str, int]
) -> None:
    """Refuse layout fields that would make kvcodec's decoder regroup a caller-layout V wrongly.

    The decoder dequantizes per-head scopes only when kv_head_count and head_dim
    are both set; then they (and page_size) must describe the bytes as they lie.
    """
    if scope not in (ScaleScope.PER_LAYER_HEAD, ScaleScope.PER_PAGE_HEAD):
        return
    if given.get("kv_head_count", -1) == -1 or given.get("head_dim", -1) == -1:
        return
    nd = v.dim()
    head = _axis(head_axis, nd, "head_axis")
    page = _axis(page_axis, nd, "page_axis") if scope == ScaleScope.PER_PAGE_HEAD else None
    want = _caller_reading(v, scope, head, page)
    bad = None if want is None else {n: x for n, x in want.items() if given.get(n, -1) not in (-1, x)}
    if want is None or bad:
        fit = "no layout fields describe it" if want is None else f"the fields that describe it are {want}"
        raise UnsupportedConfigError(
            f"encode: V is stored in the caller's layout {tuple(v.shape)} (head_axis={head_axis}, "
            f"page_axis={page_axis}); kv_head_count/head_dim/page_size {given} would make kvcodec's decoder "
            f"read it as [tokens, heads, head_dim] under the wrong {scope.name} groups; {fit}. "
            "Pass V token-major, or leave kv_head_count/head_dim unset",
            reason=Reason.BAD_VALUE,
        )


def _token_major(v: torch.Tensor, head_axis: int, page_axis: int | None) -> bool:
    """Whether ``v``'s contiguous bytes are already token-major [T,H,D] / [P,S,H,D]."""
    nd = v.dim()
    if nd not in (3, 4) or head_axis % nd != nd - 2:
        return False
    return page_axis is None or page_axis % nd == 0


def _parse_own(blob: Any) -> ParsedBlob:
    """Parse a blob this module just wrote; inconsistent caller fields are the caller's error."""
    try:
        return parse(blob, verify_crc=False)
    except CorruptEncodedKVError as e:
        raise UnsupportedConfigError(
            f"the layout fields given make an inconsistent blob: {e}", reason=Reason.INCONSISTENT_PAYLOAD
        ) from None


# ----------------------------------------------------------------------------
# install()
# ----------------------------------------------------------------------------

_SUBMODULES: dict[str, tuple[str, ...]] = {
    "errors": ("CodecError", "CodecMismatchError", "CorruptEncodedKVError", "UnsupportedConfigError"),
    "encoded_kv": (
        "CODEC_MAGIC",
        "CODEC_MAGIC_LEN",
        "_FIXED_HEADER_LEN",
        "CodecVersion",
        "ScaleScope",
        "ScaleScheme",
        "CodecHashes",
        "EncodedKV",
        "serialize_header",
        "deserialize_header",
        "encoded_kv_header_size",
        "CorruptEncodedKVError",
        "UnsupportedConfigError",
    ),
    "asym_k16_v8": (
        "AsymK16V8Codec",
        "compute_v_scales",
        "quantize_v_fp8",
        "dequantize_v_fp8",
        "_ZERO_SCALE_SENTINEL",
        "CodecHashes",
        "EncodedKV",
        "ScaleScope",
        "ScaleScheme",
    ),
}


def _real_lmcache_installed() -> bool:
    """Whether a real LMCache package can be imported (found on the path, or already imported)."""
    mod = sys.modules.get("lmcache")
    if mod is not None:
        return getattr(mod, "__file__", None) is not None
    try:
        return importlib.util.find_spec("lmcache") is not None
    except (ImportError, ValueError):
        return False


def install() -> types.ModuleType:
    """Register this module as ``lmcache.v1.kv_codec`` (+ its submodules) in ``sys.modules``.

    With a real LMCache installed, its ``lmcache`` and ``lmcache.v1`` packages
    are imported as they are and only the ``lmcache.v1.kv_codec`` subtree is
    aliased to this module: nothing of LMCache is shadowed but the codec it
    asked for. Without LMCache, minimal ``lmcache``/``lmcache.v1`` namespace
    packages are created to hold it.
    """
    me = sys.modules[__name__]
    if _real_lmcache_installed():
        import lmcache.v1  # noqa: F401 - the real packages, imported before the alias
    else:
        for pkg in ("lmcache", "lmcache.v1"):
            if pkg not in sys.modules:
                mod = types.ModuleType(pkg)
                mod.__path__ = []  # a namespace-like package
                sys.modules[pkg] = mod
        sys.modules["lmcache"].v1 = sys.modules["lmcache.v1"]  # type: ignore[attr-defined]
    for sub, names in _SUBMODULES.items():
        mod = types.ModuleType(f"lmcache.v1.kv_codec.{sub}")
        for name in names:
            setattr(mod, name, getattr(me, name))
        sys.modules[mod.__name__] = mod
        setattr(me, sub, mod)
    sys.modules["lmcache.v1.kv_codec"] = me
    sys.modules["lmcache.v1"].kv_codec = me  # type: ignore[attr-defined]
    return me

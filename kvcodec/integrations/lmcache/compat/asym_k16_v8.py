"""``lmcache.v1.kv_codec.asym_k16_v8``: LMCache's FP16/BF16-K + FP8-V codec, implemented by kvcodec.

:class:`AsymK16V8Codec` keeps LMCache's signatures, defaults and errors; the
work is kvcodec's: one encode plan (:func:`kvcodec.codec.plan_encode`) written
straight into the bytes handed out, the backends for V, and kvcodec's parser
and decoder on the way back. A V that is not token-major keeps LMCache's
caller-layout semantics (:mod:`._caller_layout`). The quant primitives
LMCache's module also exports live in :mod:`._quant`.
"""

from __future__ import annotations

from typing import Any

import torch

from .... import backends
from ....codec import DecodeRequest, EncodeSpec, check_hashes, decode_parsed, plan_encode
from ....codec.dtypes import KDTYPES, SCALE_DTYPES
from ....codec.encode import seal, write_payload
from ....errors import CorruptEncodedKVError, Reason, UnsupportedConfigError
from ....format import (
    FLOAT8_DTYPES,
    Hashes,
    Header,
    ScaleScope,
    check_consistency,
    check_stored_scales,
    header_size,
)
from ....format import assemble as _assemble
from ....hostmem import filled_bytes
from ....numerics import FP8_DTYPES
from ._caller_layout import check_caller_fields, is_token_major, parse_own
from ._quant import (
    axis_index,
    canon,
    compute_v_scales,
    dequantize_v_fp8,
    device_arg,
    dtype_arg,
    lm_scope,
    quantize_v_fp8,
    tensor_arg,
    uncanon,
)
from .encoded_kv import (
    CodecHashes,
    EncodedKV,
    ScaleScheme,
    check_record,
    deserialize_header,
    header_of,
    payload_of,
    record_of,
    serialize_header,
)
from .errors import with_lmcache_phrase

__all__ = [
    "AsymK16V8Codec",
    "CodecHashes",
    "EncodedKV",
    "ScaleScheme",
    "ScaleScope",
    "compute_v_scales",
    "dequantize_v_fp8",
    "quantize_v_fp8",
]

_ZERO_SCALE_SENTINEL = 1.0

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
        self.scale_scope = lm_scope(scale_scope, "AsymK16V8Codec scale_scope")

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
        k, v = tensor_arg(k, "encode: K"), tensor_arg(v, "encode: V")
        if k.shape != v.shape:
            raise UnsupportedConfigError(
                f"encode: K and V shapes must match; got K={tuple(k.shape)} vs V={tuple(v.shape)}",
                reason=Reason.BAD_SHAPE,
            )
        if v.dim() > 0:
            axis_index(head_axis, v.dim(), "head_axis")
            if page_axis is not None:
                axis_index(page_axis, v.dim(), "page_axis")
        scope = lm_scope(self.scale_scope, "AsymK16V8Codec scale_scope")
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
        if not is_token_major(v, head_axis, pp_axis):
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
        check_caller_fields(v, scope, head_axis, page_axis, given)
        if pre_quant is not None:
            if tensor_arg(pre_quant, "encode: precomputed_v_quant").dtype != self.fp8_dtype:
                raise UnsupportedConfigError(
                    f"encode: precomputed_v_quant dtype {pre_quant.dtype} != codec {self.fp8_dtype}",
                    reason=Reason.UNSUPPORTED_DTYPE,
                )
            q, scales = pre_quant, tensor_arg(pre_scales, "encode: precomputed_v_scales").to(self.scale_dtype)
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
        return record_of(parse_own(_assemble(h, *parts)), hashes)

    def _quantize_caller_layout(
        self, v: torch.Tensor, scope: ScaleScope, head_axis: int, page_axis: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 codes of ``v`` in its own layout and their scales, by one backend ``encode_v`` call."""
        v3, sc, ps, moved, order = canon(v, scope, head_axis, page_axis, "encode")
        q3 = torch.empty(v3.shape, dtype=self.fp8_dtype, device=v3.device)
        if v3.numel() == 0:
            scales = compute_v_scales(
                v, scope, fp8_dtype=self.fp8_dtype, head_axis=head_axis, page_axis=page_axis
            )
            return uncanon(q3, moved, order), scales.to(self.scale_dtype)
        groups = backends.Groups(sc, ps, self.fp8_dtype)
        be = backends.select(None, v3.device)
        scales = backends.call(
            be, "encode_v", v3, groups, scale_dtype=self.scale_dtype, nonfinite="error", out=q3
        )
        return uncanon(q3, moved, order), scales.reshape(()) if sc == ScaleScope.PER_TENSOR else scales

    def to_bytes(self, enc: EncodedKV) -> bytes:
        """Header + payload as ``bytes``."""
        check_record(enc)
        if enc.header_bytes is None:
            enc.header_bytes = serialize_header(enc)
        if enc._blob is not None:
            blob, payload, _ = enc._blob
            hs = len(enc.header_bytes)
            # One copy of the blob as built, unless the caller swapped payload or header.
            if enc.payload is payload and blob[:hs] == enc.header_bytes:
                return blob if type(blob) is bytes else bytes(blob)
        return bytes(enc.header_bytes) + bytes(payload_of(enc))

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
        check_record(enc)
        for name, dt in (("out_k_dtype", out_k_dtype), ("out_v_dtype", out_v_dtype)):
            if dt is not None:
                dtype_arg(dt, f"decode: {name}")
        dev = device_arg(device)
        if out_v_dtype is not None and out_v_dtype != enc.v_dtype and not out_v_dtype.is_floating_point:
            raise UnsupportedConfigError(
                f"decode: out_v_dtype {out_v_dtype} is not floating-point", reason=Reason.UNSUPPORTED_DTYPE
            )
        h = header_of(enc)
        payload = payload_of(enc)
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
        raise with_lmcache_phrase(e) from None
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
    return EncodedKV.from_header(h, blob, hs, spec.hashes)


def _check_fields(h: Header) -> None:
    """Caller layout fields must still describe the tensors (kvcodec's parser would refuse the blob)."""
    try:
        check_consistency(h)
    except CorruptEncodedKVError as e:
        raise UnsupportedConfigError(
            f"the layout fields given make an inconsistent blob: {e}", reason=Reason.INCONSISTENT_PAYLOAD
        ) from None

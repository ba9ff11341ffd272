"""Decode: an LMCKV blob -> shaped K and V, in three stages (parse, check, materialise).

1. :func:`decode` parses the buffer (bounds, then CRC, then consistency) and
   checks the identity hashes;
2. :class:`DecodeRequest` holds the validated arguments (output buffers,
   device, shape);
3. :func:`decode_parsed` builds K (bit-exact) and V (raw FP8, or dequantized
   by the chosen backend) over the payload, zero-copy where it can.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import backends
from ..env import triton_interpret
from ..errors import CodecError, Reason, UnsupportedConfigError
from ..format import (
    COMPUTED_SCOPES,
    MAX_DIM,
    MAX_ELEMENTS,
    BlobCrc,
    Header,
    ParsedBlob,
    ScaleScheme,
    ScaleScope,
    check_consistency,
    parse,
)
from ..hostmem import buffer_address, byte_span, copy_tensor, overlaps_buffer, owned_copy
from ..numerics import FP8_DTYPES
from .dtypes import VDTYPES, to_torch
from .encode import as_scales, external_scope
from .layout import check_hashes
from .lossless import Expansion, expand_payload, is_lossless

__all__ = ["DecodeRequest", "DecodedKV", "decode", "decode_parsed"]

# torch warns that a tensor over a read-only buffer is writable; kvcodec only
# reads such views (or clones them at once). Filtered once, for kvcodec's modules.
warnings.filterwarnings(
    "ignore", message="The given buffer is not writable", category=UserWarning, module=r"kvcodec(\.|$)"
)


class DecodedKV(NamedTuple):
    """What :func:`decode` returns."""

    k: torch.Tensor | None
    """K ``[tokens, heads, head_dim]`` at its stored dtype (None if the blob holds no K)."""
    v: torch.Tensor
    """V: raw FP8, or dequantized to the requested dtype, ``[tokens, heads, head_dim]``."""
    scales: torch.Tensor | None
    """V's scales as stored (scale_shape); None for external scopes without given scales."""
    header: Header


# ----------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------


def _device(device: Any, out_k: Any, out_v: Any) -> torch.device:
    if device is None:
        t = out_v if out_v is not None else out_k
        return t.device if t is not None else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise UnsupportedConfigError(f"bad device {device!r}: {e}", reason=Reason.BAD_DEVICE) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedConfigError(
            f"device {dev} requested but CUDA is not available", reason=Reason.BAD_DEVICE
        )
    if dev.type not in ("cpu", "cuda"):
        raise UnsupportedConfigError(
            f"device {dev}: kvcodec decodes to cpu or cuda", reason=Reason.BAD_DEVICE
        )
    return dev


def _check_shape(shape: Any) -> tuple[int, int, int] | None:
    if shape is None:
        return None
    try:
        dims = tuple(shape)
    except TypeError:
        raise UnsupportedConfigError(
            f"shape must be (tokens, heads, head_dim); got {shape!r}", reason=Reason.BAD_SHAPE
        ) from None
    if len(dims) != 3 or any(
        isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= MAX_DIM for d in dims
    ):
        raise UnsupportedConfigError(
            f"shape must be three ints in 0..{MAX_DIM} (tokens, heads, head_dim); got {shape!r}",
            reason=Reason.BAD_SHAPE,
        )
    if dims[1] * dims[2] > MAX_ELEMENTS:
        raise UnsupportedConfigError(
            f"shape {dims}: heads x head_dim exceeds {MAX_ELEMENTS} elements per token",
            reason=Reason.LIMIT_EXCEEDED,
        )
    return dims  # type: ignore[return-value]


def _check_out(name: str, t: Any, dtype: torch.dtype | None) -> torch.Tensor | None:
    """A caller's output tensor: dense, writable in place, no self-overlap, no autograd."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise UnsupportedConfigError(
            f"{name} must be a torch.Tensor; got {type(t).__name__}", reason=Reason.BAD_TYPE
        )
    if t.is_nested or t.layout != torch.strided or t.device.type == "meta":
        raise UnsupportedConfigError(
            f"{name} must be a dense strided tensor; got {t.layout} on {t.device}", reason=Reason.BAD_OUTPUT
        )
    if t.requires_grad:
        raise UnsupportedConfigError(
            f"{name} requires grad; decode writes in place (pass a detached tensor)", reason=Reason.BAD_OUTPUT
        )
    if dtype is not None and t.dtype != dtype:
        raise UnsupportedConfigError(
            f"{name} is {t.dtype}; the blob holds {dtype} (K is copied bit-exact, never converted)",
            reason=Reason.BAD_OUTPUT,
        )
    # 1: certainly overlapping (2: too hard to tell); a contiguous tensor cannot overlap itself, and the
    # check is a torch op that hands the GIL over (a busy Python thread beside may then keep it)
    if not t.is_contiguous() and torch._debug_has_internal_overlap(t) == 1:
        raise UnsupportedConfigError(
            f"{name} has elements sharing memory (e.g. made by expand); it cannot be written",
            reason=Reason.OVERLAP,
        )
    return t


def _fits(name: str, t: torch.Tensor, shape: tuple[int, int, int] | None, n: int) -> None:
    """``t`` is ``[tokens, heads, head_dim]``, or ``[..., heads, head_dim]`` whose leading dims hold the
    tokens; any shape of ``n`` elements when the blob has no layout (decode returns those flat)."""
    if shape is None:
        if t.numel() != n:
            raise UnsupportedConfigError(
                f"{name} has {t.numel()} elements; the blob holds {n}", reason=Reason.BAD_SHAPE
            )
        return
    if t.shape == shape:  # the common case, in one comparison
        return
    if t.dim() < 2 or tuple(t.shape[-2:]) != shape[1:] or math.prod(t.shape[:-2]) != shape[0]:
        raise UnsupportedConfigError(
            f"{name} has shape {tuple(t.shape)}; the blob's is {shape} (leading dims may split the tokens)",
            reason=Reason.BAD_SHAPE,
        )


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its byte span exactly (then span overlap is memory overlap)."""
    lo, hi = byte_span(t)
    return hi - lo == t.numel() * t.element_size()


def _check_disjoint(out_k: torch.Tensor | None, out_v: torch.Tensor | None) -> None:
    """K and V outputs may not share memory (V would overwrite K).

    Exact for dense outputs and for the same view given twice; two strided views whose
    spans interleave (K and V halves of one cache) are told apart only by their elements,
    which are not enumerated here, as torch's own copy checks do not either.
    """
    if (
        out_k is None
        or out_v is None
        or out_k.device != out_v.device
        or not out_k.numel()
        or not out_v.numel()
    ):
        return
    (k0, k1), (v0, v1) = byte_span(out_k), byte_span(out_v)
    same_view = k0 == v0 and out_k.stride() == out_v.stride()
    if same_view or (k0 < v1 and v0 < k1 and _dense(out_k) and _dense(out_v)):
        raise UnsupportedConfigError("out_k and out_v share memory; give each its own", reason=Reason.OVERLAP)


@dataclass
class DecodeRequest:
    """decode's validated arguments."""

    device: torch.device
    out_v_dtype: torch.dtype | None
    out_k: torch.Tensor | None = None
    out_v: torch.Tensor | None = None
    shape: tuple[int, int, int] | None = None
    scales: Any = None
    copy: bool = False
    backend: str | None = None

    @property
    def raw_v(self) -> bool:
        """Whether V comes back as its FP8 codes."""
        return self.out_v_dtype is None or self.out_v_dtype in FP8_DTYPES


def _request(h: Header, **kw: Any) -> DecodeRequest:
    v_dtype = to_torch(h.v_dtype)
    if v_dtype not in FP8_DTYPES:
        raise UnsupportedConfigError(
            f"blob's V dtype {h.v_dtype} is not FP8; this codec writes FP8 V", reason=Reason.UNSUPPORTED_DTYPE
        )
    out_k = _check_out("out_k", kw["out_k"], to_torch(h.k_dtype))
    out_v = _check_out("out_v", kw["out_v"], None)
    _check_disjoint(out_k, out_v)
    out_v_dtype = kw["out_v_dtype"]
    if out_v is not None:
        if out_v_dtype is None:
            out_v_dtype = out_v.dtype
        elif out_v_dtype != out_v.dtype:
            raise UnsupportedConfigError(
                f"out_v is {out_v.dtype} but out_v_dtype={out_v_dtype}", reason=Reason.BAD_OUTPUT
            )
    if out_v_dtype is not None and out_v_dtype != v_dtype and out_v_dtype not in VDTYPES:
        raise UnsupportedConfigError(
            f"V decodes to raw {h.v_dtype} or to float16, bfloat16 or float32; got {out_v_dtype}",
            reason=Reason.UNSUPPORTED_DTYPE,
        )
    device = _device(kw["device"], out_k, out_v)
    if kw["backend"] is not None:
        backends.select(kw["backend"], device)  # an explicit backend that cannot run is refused, raw V or not
    return DecodeRequest(
        device=device,
        out_v_dtype=None if out_v_dtype == v_dtype else out_v_dtype,
        out_k=out_k,
        out_v=out_v,
        shape=_check_shape(kw["shape"]),
        scales=kw["scales"],
        copy=bool(kw["copy"]),
        backend=kw["backend"],
    )


# ----------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------


def decode(
    blob: Any,
    *,
    out_v_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    expected_hashes: Any = None,
    strict_hashes: bool = False,
    scales: torch.Tensor | float | None = None,
    out_k: torch.Tensor | None = None,
    out_v: torch.Tensor | None = None,
    shape: tuple[int, int, int] | None = None,
    copy: bool = False,
    verify_crc: bool = True,
    strict: bool = False,
    backend: str | None = None,
) -> DecodedKV:
    """Decode a blob (any buffer, or a :class:`ParsedBlob`) into shaped K and V.

    V comes back as raw FP8 (``out_v_dtype=None``) or dequantized to fp16,
    bf16 or fp32, for every scope. ``out_k``/``out_v`` receive the results in
    place (any strides; ``out_k`` of K's own dtype); ``out_v``'s dtype picks
    raw or dequantized V when ``out_v_dtype`` is not given. On CPU, K and raw
    V are views into ``blob`` when it is writable and ``copy`` is False.
    ``scales`` supplies an external scope's scales; ``shape`` = (tokens,
    heads, head_dim) for blobs whose writer left the layout fields unset.
    Decoding a buffer into ``out_k`` and a dequantized ``out_v`` on CPU
    checks the CRC in the pass that writes them (the payload is read once):
    a damaged blob still raises ``CRC_MISMATCH``, but those outputs may
    have been overwritten by then.
    """
    if (
        verify_crc
        and out_k is not None
        and out_v is not None
        and scales is None
        and not isinstance(blob, ParsedBlob)
    ):
        kw = {
            "out_v_dtype": out_v_dtype,
            "device": device,
            "out_k": out_k,
            "out_v": out_v,
            "shape": shape,
            "copy": copy,
        }
        got = _decode_checked_in_pass(blob, expected_hashes, strict_hashes, strict, backend, kw)
        if got is not None:
            return got
    parsed = blob if isinstance(blob, ParsedBlob) else parse(blob, verify_crc=verify_crc, strict=strict)
    h, payload = parsed.header, parsed.payload
    if is_lossless(h):  # its plain payload, exactly (no plain blob written): decoded below as any other
        h, payload = expand_payload(parsed, reuse=out_k is not None and out_v is not None)
    if expected_hashes is not None:
        check_hashes(h.hashes, expected_hashes, strict=strict_hashes)
    req = _request(
        h,
        out_v_dtype=out_v_dtype,
        device=device,
        scales=scales,
        out_k=out_k,
        out_v=out_v,
        shape=shape,
        copy=copy,
        backend=backend,
    )
    return decode_parsed(h, payload, req)


def _decode_checked_in_pass(
    blob: Any,
    expected_hashes: Any,
    strict_hashes: bool,
    strict: bool,
    backend: str | None,
    kw: dict[str, Any],
) -> DecodedKV | None:
    """:func:`decode` into ``out_k`` and a dequantized ``out_v`` with the blob's CRC checked in the pass
    that copies K and dequantizes V (the cpu backend's host lane), so the payload is read once.

    The outputs are written before the CRC is known: a mismatch raises ``CRC_MISMATCH`` with them
    overwritten. Returns None (nothing written) for anything else, including every error met before
    the pass: the general path then decodes it, checking the CRC first, so a damaged blob is named
    as damaged whatever else it breaks. A lossless blob's CRC is checked over its coded bytes before
    any stream is decoded (in the C call that decodes them, where the C loops take it: one GIL hand-over);
    its streams are then decoded into this thread's reused plain payload (no plain blob written or
    parsed), which the same pass copies out of (or, where the host lane does not take it, the general
    decode of that payload: the CRC already checked, nothing left to decode twice).
    """
    try:
        parsed = parse(blob, verify_crc=False, strict=strict)
        h, payload, lossless = parsed.header, parsed.payload, is_lossless(parsed.header)
        if lossless:  # its plain payload in this thread's reused buffer; the coded CRC checked by fill
            expansion = Expansion(parsed, reuse=True)  # the scales written, the streams decoded below
            h, payload = expansion.header, expansion.payload
        else:
            blob_crc = BlobCrc(parsed)
        if expected_hashes is not None:
            check_hashes(h.hashes, expected_hashes, strict=strict_hashes)
        req, lane, deq = _lane(h, payload, backend, kw, lossless)
        k_into = _k_bytes(req.out_k, h) if lossless and lane is not None else None
        if lossless:  # the coded blob's CRC, K merged straight into out_k and V dequantized where they can be
            deq_args = None if k_into is None or deq is None else deq.args(lane[1], lane[3])
            fused = expansion.fill(k_into=k_into, crc=True, deq=deq_args)
    except CodecError:
        return None
    if lane is None:
        return decode_parsed(h, payload, req) if lossless else None
    be, s_t, groups, target = lane
    if lossless and fused is True:  # V dequantized in the call that expanded its codes
        return DecodedKV(req.out_k, req.out_v, s_t, h)
    if lossless and fused is not False:  # declined there (NaN codes: out_v partly written), as decode_host's
        backends.note_declined(be, "expand_dequant", fused)
        served = None
    else:
        served = backends.call(
            be,
            "decode_host",
            payload,
            h.k_payload_len,
            s_t,
            groups,
            req.out_k,
            target,
            crc=None if lossless else blob_crc.seed,
            k_done=k_into is not None,
            fallback=lambda: None,
        )
    if served is None:  # declined: C wrote nothing, or stopped at NaN codes: rewritten here
        if not lossless:
            blob_crc.finish(None)
        elif k_into is not None:  # K lies in out_k alone: the general path copies it from the payload
            payload[: h.k_payload_len] = k_into
        return decode_parsed(h, payload, req)
    if not lossless:
        blob_crc.finish(served.crc, blob_crc.codes_end)
    return DecodedKV(req.out_k, req.out_v, s_t, h)


def _deq_plan(lane: tuple[Any, torch.Tensor, backends.Groups, torch.Tensor] | None) -> Any:
    """The host lane's dequantization planned for the lossless expansion's C call (the backend's
    ``expand_dequant`` lane), so a lossless blob's codes are dequantized in the call that writes them;
    None where the backend has no such lane or declines it (its ``decode_host`` then)."""
    if lane is None or "expand_dequant" not in lane[0].lanes:
        return None
    be, s_t, groups, target = lane
    return backends.call(be, "expand_dequant", s_t, groups, target, fallback=lambda: None)


class _LanePlan(NamedTuple):
    """What the checks of a decode into ``out_k`` and a dequantized ``out_v`` decided for one header
    layout and two outputs, remembered by :func:`_lane` under :func:`_lane_key` (never the tensors)."""

    key: tuple[Any, ...]
    device: torch.device
    out_v_dtype: torch.dtype | None
    backend: backends.Backend
    groups: backends.Groups
    deq: Any


_plans = threading.local()
"""This thread's last :class:`_LanePlan` (``.last``): a connector decodes one layout into the same
outputs layer after layer, chunk after chunk."""


def _out_key(t: Any) -> tuple[Any, ...] | None:
    """What decode's checks of output ``t`` read: its address, shape, strides, dtype, device and grad
    (None for a tensor they treat otherwise, which is then checked on every decode)."""
    if type(t) is not torch.Tensor or t.is_nested or t.layout != torch.strided or t.is_neg() or t.is_conj():
        return None
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


def _lane_key(h: Header, backend: Any, kw: dict[str, Any], lossless: bool) -> tuple[Any, ...] | None:
    """Everything the request and host lane checks read but the payload and the scales (each blob's,
    checked on every decode), and whether the blob is lossless (its plan has a dequantization plan);
    None where a plan is not kept (a device or shape given, odd outputs)."""
    if kw["device"] is not None or kw["shape"] is not None or not (backend is None or type(backend) is str):
        return None
    k, v = _out_key(kw["out_k"]), _out_key(kw["out_v"])
    if k is None or v is None:
        return None
    env = (os.environ.get("KVCODEC_BACKEND"), triton_interpret())
    layout = (h.k_dtype, h.v_dtype, h.k_payload_len, h.v_payload_len, h.scale_payload_len, h.scale_dtype)
    scales = (h.scale_scope, h.scale_scheme, h.scale_shape, h.kv_head_count, h.head_dim, h.page_size)
    return (k, v, kw["out_v_dtype"], bool(kw["copy"]), backend, env, layout, scales, lossless)


def _lane(
    h: Header, payload: memoryview, backend: str | None, kw: dict[str, Any], lossless: bool
) -> tuple[DecodeRequest, tuple[Any, torch.Tensor, backends.Groups, torch.Tensor] | None, Any]:
    """The request, host lane inputs (:func:`_host_lane_inputs`) and, for a ``lossless`` blob, the
    dequantization plan of its expanding call (:func:`_deq_plan`; None for a plain blob) of a decode
    checked in the pass. Where the thread's last plan has this decode's :func:`_lane_key`, its
    decisions stand and only the per-blob steps run (the payload's size and overlaps, the scales): the
    checks of the outputs and layout took about a tenth of a 256-token lossless blob's decode (bench)."""
    key = _lane_key(h, backend, kw, lossless)
    plan = getattr(_plans, "last", None)
    if key is not None and plan is not None and plan.key == key:
        got = _lane_again(plan, h, payload, backend, kw)
        if got is not None:
            return got
    req = _request(h, scales=None, backend=backend, **kw)
    lane = _host_lane_inputs(h, payload, req)
    deq = _deq_plan(lane) if lossless else None
    if key is not None and lane is not None:
        _plans.last = _LanePlan(key, req.device, req.out_v_dtype, lane[0], lane[2], deq)
    return req, lane, deq


def _lane_again(
    plan: _LanePlan, h: Header, payload: memoryview, backend: str | None, kw: dict[str, Any]
) -> tuple[DecodeRequest, tuple[Any, torch.Tensor, backends.Groups, torch.Tensor], Any] | None:
    """A remembered plan's per-blob steps, or None where this blob needs the full checks (a payload
    too short or under an output, or another backend selected now)."""
    if backends.select(backend, plan.device) is not plan.backend:
        return None
    if len(payload) < h.k_payload_len + h.v_payload_len + h.scale_payload_len:
        return None
    out_k, out_v = kw["out_k"], kw["out_v"]
    base = buffer_address(payload)
    if overlaps_buffer(out_k, payload, base) or overlaps_buffer(out_v, payload, base):
        return None
    req = DecodeRequest(plan.device, plan.out_v_dtype, out_k, out_v, None, None, bool(kw["copy"]), backend)
    return req, (plan.backend, _scale_tensor(h, payload, req), plan.groups, out_v), plan.deq


def _k_bytes(out_k: torch.Tensor, h: Header) -> memoryview | None:
    """``out_k``'s bytes to merge a lossless blob's K into (CPU, C-contiguous, exactly K's bytes; its
    dtype and grad already checked by ``_request``), or None: K then goes through the payload as a
    plain blob's does."""
    if (
        out_k.device.type != "cpu"
        or not out_k.is_contiguous()
        or out_k.numel() * out_k.element_size() != h.k_payload_len
    ):
        return None
    return memoryview(out_k.view(torch.uint8).numpy()).cast("B")


def _host_lane_inputs(
    h: Header, payload: memoryview, req: DecodeRequest
) -> tuple[Any, torch.Tensor, backends.Groups, torch.Tensor] | None:
    """(backend, scales, groups, V's target) when the backend's host lane can decode ``h``'s payload:
    CPU, K present, stored scales of a computed scope, ``out_v`` dequantized in place; else None."""
    if req.device.type != "cpu" or req.raw_v or not h.k_payload_len or not h.scale_payload_len:
        return None
    if h.scale_scope not in COMPUTED_SCOPES or h.scale_scheme == ScaleScheme.UNIT:
        return None
    be = backends.select(req.backend, req.device)
    if "decode_host" not in be.lanes:
        return None
    n = h.v_payload_len // h.v_dtype.itemsize
    shape = _shape(h, n, req.shape)
    if shape is None or len(payload) < h.k_payload_len + h.v_payload_len + h.scale_payload_len:
        return None
    _fits("out_k", req.out_k, shape, h.k_payload_len // h.k_dtype.itemsize)
    _fits("out_v", req.out_v, shape, n)
    base = buffer_address(payload)  # once for both outputs
    if overlaps_buffer(req.out_k, payload, base) or overlaps_buffer(req.out_v, payload, base):
        return None  # the general path refuses it
    s_t = _scale_tensor(h, payload, req)
    groups, dq_shape = _groups(h, s_t, shape, n)
    if s_t is None or tuple(req.out_v.shape) != dq_shape or not req.out_v.is_contiguous():
        return None
    return be, s_t, groups, req.out_v


def _shape(h: Header, n: int, given: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
    """(tokens, heads, head_dim) of the payload: from ``shape=``, else the layout fields (None: unknown)."""
    if given is not None:
        if math.prod(given) != n:
            raise UnsupportedConfigError(
                f"shape {given} does not hold the blob's {n} elements as (T, H, D)", reason=Reason.BAD_SHAPE
            )
        if h.kv_head_count > 0 and h.head_dim > 0 and given[1:] != (h.kv_head_count, h.head_dim):
            raise UnsupportedConfigError(
                f"shape {given} contradicts the blob's kv_head_count={h.kv_head_count}, head_dim={h.head_dim}",
                reason=Reason.BAD_SHAPE,
            )
        return given
    if h.kv_head_count > 0 and h.head_dim > 0:
        return (n // (h.kv_head_count * h.head_dim), h.kv_head_count, h.head_dim)
    if n == 0:
        return (0, max(h.kv_head_count, 1), max(h.head_dim, 1))
    return None


def _tensor(mv: memoryview, dtype: torch.dtype, own: bool) -> torch.Tensor:
    """A tensor over ``mv``: a view, or a copy when ``own`` (a read-only buffer or ``copy=True``)."""
    if not len(mv):
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(owned_copy(mv) if own else mv, dtype=torch.uint8).view(dtype)


def _kv_tensors(
    h: Header, payload: memoryview, req: DecodeRequest
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Flat K (None when the blob has none) and FP8 V on the request's device."""
    k_len, v_len = h.k_payload_len, h.v_payload_len
    has_k = bool(k_len) or not v_len  # an empty chunk has an (empty) K
    k_dt, v_dt = to_torch(h.k_dtype), to_torch(h.v_dtype)
    if req.device.type != "cpu":
        raw = _tensor(payload[: k_len + v_len], torch.uint8, False).to(req.device)
        return (raw[:k_len].view(k_dt) if has_k else None), raw[k_len:].view(v_dt)
    own = payload.readonly or req.copy
    v_read_only = not req.raw_v or req.out_v is not None  # V is only read: never copied
    if own and not v_read_only and k_len + v_len:
        both = _tensor(payload[: k_len + v_len], torch.uint8, True)  # one copy of K and V together
        return (both[:k_len].view(k_dt) if has_k else None), both[k_len:].view(v_dt)
    k = _tensor(payload[:k_len], k_dt, own and req.out_k is None) if has_k else None
    return k, _tensor(payload[k_len : k_len + v_len], v_dt, False)


_NP_OF = {torch.float16: np.float16, torch.float32: np.float32}
"""Scale dtypes numpy has: their copy is one numpy call (no bytearray, no torch view)."""


def _stored_scales(
    payload: memoryview, off: int, n: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A copy of the ``n`` scale bytes at ``off``, as a CPU tensor of ``dtype`` and ``shape``."""
    np_dt = _NP_OF.get(dtype)
    if np_dt is None:
        return _tensor(payload[off : off + n], dtype, True).reshape(shape)
    return torch.from_numpy(np.frombuffer(payload, np_dt, n // dtype.itemsize, off).reshape(shape).copy())


def _scale_tensor(h: Header, payload: memoryview, req: DecodeRequest) -> torch.Tensor | None:
    """V's scales: stored, unit, or the caller's for an external scope."""
    dev, s_dt = req.device, to_torch(h.scale_dtype)
    if h.scale_scope == ScaleScope.NONE or h.scale_scheme == ScaleScheme.UNIT:
        return torch.ones((), dtype=torch.float32, device=dev)
    if h.scale_payload_len:
        off = h.k_payload_len + h.v_payload_len
        s_t = _stored_scales(payload, off, h.scale_payload_len, s_dt, h.scale_shape)
        if s_t.device != dev:  # a torch op even where it moves nothing, and each hands the GIL over
            s_t = s_t.to(dev)
        if req.scales is not None:
            given = as_scales(req.scales, dev, s_dt)
            if given.numel() != s_t.numel() or not torch.equal(given.reshape(s_t.shape), s_t):
                raise UnsupportedConfigError(
                    "scales= given, but the blob stores its own, different scales", reason=Reason.BAD_SCALES
                )
        return s_t
    if h.scale_scope in COMPUTED_SCOPES and math.prod(h.scale_shape) == 0:
        return torch.empty(h.scale_shape, dtype=s_dt, device=dev)
    if h.scale_scope == ScaleScope.EXTERNAL and req.scales is not None:
        return as_scales(req.scales, dev, s_dt)  # quantized with them cast to the blob's scale dtype
    return None


def _into(
    name: str, dst: torch.Tensor, src: torch.Tensor, shape: tuple[int, int, int] | None, payload: memoryview
) -> None:
    _fits(name, dst, shape, src.numel())
    if overlaps_buffer(dst, payload):
        raise UnsupportedConfigError(
            f"{name} overlaps the blob being decoded; decode into separate memory", reason=Reason.OVERLAP
        )
    copy_tensor(dst, src.view(dst.shape))


def _groups(
    h: Header, s_t: torch.Tensor, shape: tuple[int, int, int] | None, n: int
) -> tuple[backends.Groups, tuple[int, int, int]]:
    """The scale grouping V was quantized with, and the shape to dequantize it in."""
    if h.scale_scope == ScaleScope.NONE or h.scale_scheme == ScaleScheme.UNIT:
        scope = ScaleScope.PER_TENSOR
    elif h.scale_scope == ScaleScope.EXTERNAL:
        scope = external_scope(s_t, shape[1] if shape is not None else 1)
    else:
        scope = h.scale_scope
    if shape is None:
        if scope != ScaleScope.PER_TENSOR:
            raise UnsupportedConfigError(
                f"the blob leaves kv_head_count/head_dim unset and its {h.scale_scope.name} scales need "
                "them: pass shape=(tokens, heads, head_dim)",
                reason=Reason.MISSING_ARGUMENT,
            )
        shape = (1, 1, n)  # one scale for all: any grouping of the elements will do
    ps = h.page_size if h.page_size > 0 else None
    return backends.Groups(scope, ps, to_torch(h.v_dtype)), shape


def _dequantize(
    h: Header,
    v_t: torch.Tensor,
    s_t: torch.Tensor | None,
    req: DecodeRequest,
    shape: tuple[int, int, int] | None,
    payload: memoryview,
) -> torch.Tensor:
    """V dequantized into ``req.out_v`` (or a new tensor of ``shape``, flat when unknown)."""
    n = v_t.numel()
    if s_t is None and n == 0:  # nothing to scale: an empty V of the asked dtype
        out = torch.empty(shape if shape is not None else (0,), dtype=req.out_v_dtype, device=req.device)
        return req.out_v if req.out_v is not None else out
    if s_t is None:
        if h.scale_scope == ScaleScope.EXTERNAL:
            raise UnsupportedConfigError(
                "cannot dequantize an external-scope blob without its scales: pass scales=",
                reason=Reason.MISSING_ARGUMENT,
            )
        raise UnsupportedConfigError(
            f"cannot dequantize: this {h.scale_scope.name.lower()} blob stores no scales",
            reason=Reason.BAD_SCOPE,
        )
    groups, dq_shape = _groups(h, s_t, shape, n)
    be = backends.select(req.backend, req.device)
    dst = req.out_v
    target = None
    if dst is not None:
        _fits("out_v", dst, shape, n)
        if overlaps_buffer(dst, payload):
            raise UnsupportedConfigError(
                "out_v overlaps the blob being decoded; decode into separate memory", reason=Reason.OVERLAP
            )
        try:
            target = dst.view(dq_shape)  # written in place
        except RuntimeError:
            target = None  # strides that cannot take that shape: go through a temporary
    in_place = target is not None
    if target is None:
        target = torch.empty(dq_shape, dtype=req.out_v_dtype, device=req.device)
    if n:  # an empty V needs no backend (and is no fallback)
        backends.call(be, "dequantize", v_t.reshape(dq_shape), s_t, groups, out=target)
    if dst is None:
        return target if shape is not None else target.reshape(-1)
    if not in_place:
        copy_tensor(dst, target.reshape(dst.shape))
    return dst


def decode_parsed(h: Header, payload: memoryview, req: DecodeRequest) -> DecodedKV:
    """Decode from a header and its payload view (see :func:`decode`).

    Without layout fields and without ``shape``, K and V come back flat; they
    can still be dequantized where the scope needs no layout (per tensor, unit).
    """
    check_consistency(h)  # a header-level parse (consistency=False) left this to decode
    n = h.v_payload_len // h.v_dtype.itemsize
    shape = _shape(h, n, req.shape)
    k_t, v_t = _kv_tensors(h, payload, req)
    s_t = _scale_tensor(h, payload, req)
    if shape is not None:
        k_t = k_t.view(shape) if k_t is not None else None
        v_t = v_t.view(shape)
    if req.out_k is not None:
        if k_t is None:
            raise UnsupportedConfigError("out_k given but the blob holds no K", reason=Reason.BAD_OUTPUT)
        _into("out_k", req.out_k, k_t, shape, payload)
        k_t = req.out_k
    if not req.raw_v:
        return DecodedKV(k_t, _dequantize(h, v_t, s_t, req, shape, payload), s_t, h)
    if req.out_v is not None:
        if req.out_v.dtype != v_t.dtype:
            raise UnsupportedConfigError(
                f"out_v is {req.out_v.dtype}; raw V is {v_t.dtype}", reason=Reason.BAD_OUTPUT
            )
        _into("out_v", req.out_v, v_t, shape, payload)
        v_t = req.out_v
    return DecodedKV(k_t, v_t, s_t, h)

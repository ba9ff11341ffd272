"""Encode: K/V tensors -> one LMCKV blob, in three stages (plan, write, seal).

1. :func:`plan_encode` validates the tensors and the :class:`EncodeSpec` and
   lays out the header: nothing is written yet.
2. :func:`write_payload` fills ``K ‖ V ‖ scales`` straight into the output
   buffer: K copied bit-exact, V quantized by the chosen backend.
3. :func:`seal` packs the header in front of the payload with its CRC.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import backends
from ..env import triton_interpret
from ..errors import Reason, UnsupportedConfigError
from ..format import (
    COMPUTED_SCOPES,
    Hashes,
    Header,
    HeaderPacker,
    ParsedBlob,
    ScaleScheme,
    ScaleScope,
    as_bytes_view,
    header_size,
    pack_header_into,
    parse,
    payload_crc,
)
from ..hostmem import buffer_address, copy_scale_bytes, copy_tensor, new_buffer, overlaps_buffer
from ..numerics import FP8_DTYPES, check_amax, check_layers_amax, check_scales, scale_shape
from .dtypes import KDTYPES, SCALE_DTYPES, VDTYPES, to_torch
from .layout import normalize_layout, resolve_scope
from .lossless import COMPRESSIONS, Planes, compress_blob, plain_scratch
from .lossless_device import split_host, split_to_host
from .spec import EncodeSpec

__all__ = [
    "EncodePlan",
    "as_scales",
    "encode",
    "encode_layers",
    "encoded_size",
    "external_scope",
    "plan_encode",
    "seal",
    "write_payload",
]


@dataclass
class EncodePlan:
    """A validated encode: the header to write and what fills the payload."""

    header: Header
    k: torch.Tensor | None
    """K, token-major ``[tokens, heads, head_dim]`` (None for a V-only blob)."""
    v: torch.Tensor
    """V token-major: floats to quantize, or FP8 codes to pass through (``fp8_given``)."""
    fp8_given: bool
    scales: torch.Tensor | None
    """Scales to quantize with (external, precomputed, raw's unit); None: computed from V."""
    groups: backends.Groups
    backend: backends.Backend
    nonfinite: str

    @property
    def fusable(self) -> bool:
        """Whether one fused Triton launch can write K, FP8 V and the scales."""
        h = self.header
        return (
            "encode_fused" in self.backend.lanes
            and self.scales is None
            and self.k is not None
            and str(h.k_dtype) in ("float16", "bfloat16")
            and h.v_payload_len > 0
            and str(h.scale_dtype) == "float32"
            and self.nonfinite == "error"
        )


# ----------------------------------------------------------------------------
# Stage 1: plan
# ----------------------------------------------------------------------------


def _check_tensor(name: str, x: Any) -> torch.Tensor:
    """A dense, materialised tensor (not meta, sparse, nested), detached from autograd, with any lazy
    negation or conjugation applied (copies read memory as stored, which would lose the sign)."""
    if not isinstance(x, torch.Tensor):
        raise UnsupportedConfigError(
            f"{name} must be a torch.Tensor; got {type(x).__name__}", reason=Reason.BAD_TYPE
        )
    if x.is_nested or x.layout != torch.strided or x.device.type == "meta":
        raise UnsupportedConfigError(
            f"{name} must be a dense strided tensor with data; got {x.layout} on {x.device}",
            reason=Reason.BAD_TYPE,
        )
    x = x.detach()
    return x.resolve_neg().resolve_conj() if x.is_neg() or x.is_conj() else x


def _check_int(name: str, value: Any, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise UnsupportedConfigError(
            f"{name} must be an int; got {type(value).__name__} {value!r}", reason=Reason.BAD_TYPE
        )
    if value < minimum:
        raise UnsupportedConfigError(f"{name} must be >= {minimum}; got {value}", reason=Reason.BAD_VALUE)
    return value


def _check_options(spec: EncodeSpec) -> tuple[ScaleScope, int]:
    """Scope and header version, after the dtype and policy options are checked."""
    sc = resolve_scope(spec.scope)
    if spec.v_dtype == torch.float8_e5m2 and not spec.allow_e5m2:
        raise UnsupportedConfigError(
            "float8_e5m2 V is opt-in: pass allow_e5m2=True", reason=Reason.UNSUPPORTED_DTYPE
        )
    if spec.v_dtype not in FP8_DTYPES:
        raise UnsupportedConfigError(
            f"v_dtype must be float8_e4m3fn or float8_e5m2; got {spec.v_dtype}",
            reason=Reason.UNSUPPORTED_DTYPE,
        )
    if spec.scale_dtype not in SCALE_DTYPES:
        raise UnsupportedConfigError(
            f"scale_dtype must be float32 or float16; got {spec.scale_dtype}", reason=Reason.UNSUPPORTED_DTYPE
        )
    if spec.nonfinite not in ("error", "saturate"):
        raise UnsupportedConfigError(
            f"nonfinite must be 'error' or 'saturate'; got {spec.nonfinite!r}", reason=Reason.BAD_VALUE
        )
    version = spec.version
    if sc == ScaleScope.NONE and type(version) is int:
        version = max(version, 2)
    if type(version) is not int or version not in (1, 2):
        raise UnsupportedConfigError(
            f"header version must be 1 or 2; got {version!r}", reason=Reason.UNSUPPORTED_VERSION
        )
    for name in ("layer_id", "chunk_id", "chunk_size", "kv_head_count", "head_dim"):
        _check_int(name, getattr(spec, name), -1)
    _check_int("page_size", spec.page_size, 1)
    return sc, version


def _token_major(
    k: Any, v: Any, spec: EncodeSpec
) -> tuple[torch.Tensor | None, torch.Tensor, bool, int | None]:
    """K and V (or precomputed FP8 V) as ``[tokens, heads, head_dim]``, and the page size."""
    q = spec.precomputed_v_quant
    src = _check_tensor("precomputed_v_quant" if v is None else "v", v if v is not None else q)
    if src is None:
        raise UnsupportedConfigError(
            "encode needs v, or precomputed_v_quant with its scales", reason=Reason.MISSING_ARGUMENT
        )
    ax = {"head_axis": spec.head_axis, "page_axis": spec.page_axis}
    v3, lay = normalize_layout(src, **ax)
    if q is not None:
        q = _check_tensor("precomputed_v_quant", q)
        if q.dtype != spec.v_dtype:
            raise UnsupportedConfigError(
                f"encode: precomputed_v_quant dtype {q.dtype} != codec {spec.v_dtype}",
                reason=Reason.UNSUPPORTED_DTYPE,
            )
        if tuple(q.shape) != tuple(src.shape):
            raise UnsupportedConfigError(
                f"precomputed_v_quant shape {tuple(q.shape)} != V {tuple(src.shape)}", reason=Reason.BAD_SHAPE
            )
        v3 = normalize_layout(q, **ax)[0]
    elif v3.dtype not in VDTYPES:
        raise UnsupportedConfigError(
            f"V dtype must be float16, bfloat16 or float32; got {v3.dtype}", reason=Reason.UNSUPPORTED_DTYPE
        )
    k3 = None
    if k is not None:
        k = _check_tensor("k", k)
        if tuple(k.shape) != tuple(src.shape):
            raise UnsupportedConfigError(
                f"encode: K and V shapes must match; got K={tuple(k.shape)} vs V={tuple(src.shape)}",
                reason=Reason.BAD_SHAPE,
            )
        if k.dtype not in KDTYPES:
            raise UnsupportedConfigError(
                f"K dtype must be float16, bfloat16 or float32; got {k.dtype}",
                reason=Reason.UNSUPPORTED_DTYPE,
            )
        if k.device != src.device:
            raise UnsupportedConfigError(
                f"K is on {k.device} but V on {src.device}", reason=Reason.BAD_DEVICE
            )
        k3 = normalize_layout(k, **ax)[0]
    ps = spec.page_size if spec.page_size is not None else lay.page_size
    return k3, v3, q is not None, ps


def as_scales(scales: Any, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Caller scales (tensor, float, numpy) as a tensor of the blob's scale dtype."""
    if isinstance(scales, torch.Tensor):
        _check_tensor("scales", scales)
    try:
        return torch.as_tensor(scales).to(device=device, dtype=dtype)
    except (TypeError, ValueError, RuntimeError) as e:
        raise UnsupportedConfigError(
            f"scales must be a tensor or a number; got {type(scales).__name__}: {e}", reason=Reason.BAD_SCALES
        ) from None


def external_scope(scales: torch.Tensor, heads: int) -> ScaleScope:
    """The computed scope whose scale shape ``scales`` has (for external scales)."""
    if scales.dim() == 0 or (scales.dim() == 1 and scales.shape[0] == 1 and heads != 1):
        return ScaleScope.PER_TENSOR
    if scales.dim() == 1 and scales.shape[0] == heads:
        return ScaleScope.PER_LAYER_HEAD
    if scales.dim() == 2 and scales.shape[1] == heads:
        return ScaleScope.PER_PAGE_HEAD
    raise UnsupportedConfigError(
        f"external scales of shape {tuple(scales.shape)} fit no scope: expected (), ({heads},) or (pages, {heads})",
        reason=Reason.BAD_SCALES,
    )


def _plan_scales(
    spec: EncodeSpec, sc: ScaleScope, v3: torch.Tensor, fp8_given: bool, ps: int | None
) -> tuple[torch.Tensor | None, ScaleScope]:
    """The scales to quantize with (None: computed) and the grouping they imply."""
    dev, heads = v3.device, v3.shape[1]
    if sc == ScaleScope.NONE:
        if spec.scales is not None:
            raise UnsupportedConfigError(
                "scope raw has unit scales; scales= does not apply", reason=Reason.BAD_SCALES
            )
        return torch.ones((), dtype=torch.float32, device=dev), ScaleScope.PER_TENSOR
    given = spec.precomputed_v_scales if fp8_given else spec.scales
    if fp8_given and given is None:
        raise UnsupportedConfigError(
            "encode: precomputed_v_quant requires precomputed_v_scales", reason=Reason.MISSING_ARGUMENT
        )
    if given is None:
        if sc == ScaleScope.EXTERNAL:
            raise UnsupportedConfigError(
                "scope external needs the caller's scales (scales=...)", reason=Reason.MISSING_ARGUMENT
            )
        if sc == ScaleScope.PER_PAGE_HEAD and ps is None:
            raise UnsupportedConfigError(
                "per_page_head needs page_size= or a paged [pages, page_size, heads, head_dim] input",
                reason=Reason.MISSING_ARGUMENT,
            )
        return None, sc
    if not fp8_given and sc != ScaleScope.EXTERNAL:
        raise UnsupportedConfigError(
            "scales= is for scope external; use precomputed_v_scales", reason=Reason.BAD_SCALES
        )
    scales = as_scales(given, dev, spec.scale_dtype)
    group_scope = external_scope(scales, heads) if sc == ScaleScope.EXTERNAL else sc
    check_scales(scales, group_scope, "given scale")
    if group_scope == ScaleScope.PER_PAGE_HEAD and ps is None:
        raise UnsupportedConfigError("(pages, heads) scales need page_size", reason=Reason.MISSING_ARGUMENT)
    want = scale_shape(group_scope, v3.shape[0], heads, ps)
    if tuple(scales.shape) != want and not (sc == ScaleScope.EXTERNAL and scales.numel() == 1 and want == ()):
        raise UnsupportedConfigError(
            f"scales of shape {tuple(scales.shape)} do not fit scope {sc.name} over {v3.shape[0]} tokens x "
            f"{heads} heads (page_size {ps}); expected {want}",
            reason=Reason.BAD_SCALES,
        )
    return scales.reshape(want), group_scope


def _make_header(
    spec: EncodeSpec,
    sc: ScaleScope,
    version: int,
    k3: torch.Tensor | None,
    v3: torch.Tensor,
    ps: int | None,
    scales: torch.Tensor | None,
) -> Header:
    """The header of the planned blob (lengths from the tensors, layout fields checked against them)."""
    tokens, heads, dim = v3.shape
    computed = sc in COMPUTED_SCOPES
    store = spec.store_scales
    if store is None or sc == ScaleScope.NONE:
        store = computed
    elif computed and not store:
        raise UnsupportedConfigError(f"scope {sc.name} always stores its scales", reason=Reason.BAD_SCALES)
    if scales is None:
        shape = scale_shape(sc, tokens, heads, ps)
    else:
        shape = tuple(scales.shape) if sc != ScaleScope.NONE else ()
    given = {"kv_head_count": heads, "head_dim": dim}
    for name, actual in given.items():
        value = getattr(spec, name)
        if value is not None and value not in (-1, actual):
            raise UnsupportedConfigError(
                f"{name}={value} but the tensors have {actual}", reason=Reason.BAD_SHAPE
            )
    if spec.chunk_size not in (None, -1) and spec.chunk_size < tokens:
        raise UnsupportedConfigError(
            f"chunk_size={spec.chunk_size} is smaller than the {tokens} tokens given", reason=Reason.BAD_VALUE
        )
    k_dtype = k3.dtype if k3 is not None else torch.float16
    elems = tokens * heads * dim
    return Header(
        k_dtype=k_dtype,
        v_dtype=spec.v_dtype,
        scale_dtype=spec.scale_dtype,
        scale_scope=sc,
        version=version,
        scale_scheme=ScaleScheme.UNIT if sc == ScaleScope.NONE else ScaleScheme.COMPUTED,
        layer_id=spec.layer_id,
        chunk_id=spec.chunk_id,
        chunk_size=tokens if spec.chunk_size is None else spec.chunk_size,
        page_size=-1 if ps is None else ps,
        kv_head_count=heads if spec.kv_head_count is None else spec.kv_head_count,
        head_dim=dim if spec.head_dim is None else spec.head_dim,
        scale_shape=shape,
        k_payload_len=elems * k_dtype.itemsize if k3 is not None else 0,
        v_payload_len=elems,
        scale_payload_len=(math.prod(shape) if store else 0) * spec.scale_dtype.itemsize,
        hashes=Hashes.coerce(spec.hashes),
    )


def plan_encode(k: Any, v: Any, spec: EncodeSpec) -> EncodePlan:
    """Validate an encode and lay out its blob: everything short of writing it."""
    sc, version = _check_options(spec)
    k3, v3, fp8_given, ps = _token_major(k, v, spec)
    scales, group_scope = _plan_scales(spec, sc, v3, fp8_given, ps)
    header = _make_header(spec, sc, version, k3, v3, ps, scales)
    return EncodePlan(
        header=header,
        k=k3,
        v=v3,
        fp8_given=fp8_given,
        scales=scales,
        groups=backends.Groups(group_scope, ps, spec.v_dtype),
        backend=backends.select(spec.backend, v3.device),
        nonfinite=spec.nonfinite,
    )


# ----------------------------------------------------------------------------
# Stage 2: write the payload
# ----------------------------------------------------------------------------


def _sections(p: EncodePlan, payload: Any) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """K, V-code and scale-byte views of the payload: a uint8 tensor (any device) or host bytes."""
    h = p.header
    k_len, v_len = h.k_payload_len, h.v_payload_len
    shape = tuple(p.v.shape)
    k_dt, v_dt = to_torch(h.k_dtype), to_torch(h.v_dtype)
    if isinstance(payload, memoryview):
        return _host_sections(payload, k_len, v_len, shape, k_dt, v_dt)
    k_dst = payload[:k_len].view(k_dt).view(shape) if k_len else None
    q_dst = payload[k_len : k_len + v_len].view(v_dt).view(shape) if v_len else None
    return k_dst, q_dst, payload[k_len + v_len :]


_NP_OF = {torch.float16: np.float16, torch.float32: np.float32}


def _host_view(
    mv: memoryview, offset: int, n: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A tensor over ``n`` bytes of host memory, made through numpy: numpy's views take no GIL
    hand-over, and a torch ``view`` is needed only for dtypes numpy lacks (bf16, FP8)."""
    raw = np.frombuffer(mv, np.uint8, n, offset)
    if dtype in _NP_OF:
        return torch.from_numpy(raw.view(_NP_OF[dtype]).reshape(shape))
    ints = raw.view(np.int16) if dtype.itemsize == 2 else raw
    return torch.from_numpy(ints.reshape(shape)).view(dtype)


def _host_sections(
    mv: memoryview, k_len: int, v_len: int, shape: tuple[int, ...], k_dt: torch.dtype, v_dt: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    k_dst = _host_view(mv, 0, k_len, k_dt, shape) if k_len else None
    q_dst = _host_view(mv, k_len, v_len, v_dt, shape) if v_len else None
    s_len = len(mv) - k_len - v_len
    return k_dst, q_dst, torch.from_numpy(np.frombuffer(mv, np.uint8, s_len, k_len + v_len))


def _host_lane(p: EncodePlan, payload: Any, crc_seed: int | None, k_copy: bool) -> backends.Served | None:
    """The backend's optional host lane: the whole payload (K, codes, scales) written into host memory
    in one call. Returns what it served (its ``crc``: the payload's CRC continued from ``crc_seed`` when
    the lane folded it in), or None when it did not write the payload (the generic path then does;
    nothing it needs was lost)."""
    if (
        "encode_host" not in p.backend.lanes
        or not isinstance(payload, memoryview)
        or p.k is None
        or p.scales is not None
        or p.fp8_given
    ):
        return None
    sdt = to_torch(p.header.scale_dtype)
    return backends.call(
        p.backend,
        "encode_host",
        p.k,
        p.v,
        p.groups,
        payload,
        scale_dtype=sdt,
        nonfinite=p.nonfinite,
        crc=crc_seed,
        k_copy=k_copy,
        fallback=lambda: None,
    )


def write_payload(
    p: EncodePlan, payload: Any, crc_seed: int | None = None, *, k_bytes: bool = True
) -> int | None:
    """Fill ``payload`` (``header.payload_len`` bytes: a uint8 tensor on V's device, or a writable
    memoryview of host memory for CPU tensors) with K, FP8 V and the scales.

    With ``crc_seed`` (the CRC of what precedes the payload) returns the CRC continued over the
    payload when the pass that wrote it computed it too (the cpu backend's host lane), else None
    (the caller computes it, as :func:`seal` does). ``k_bytes=False``: K's bytes may be left unwritten
    (the lossless stage codes K's planes split from ``p.k``)."""
    if p.fusable:
        if isinstance(payload, memoryview):
            payload = torch.frombuffer(payload, dtype=torch.uint8)
        amax = p.backend.encode_fused(p.k, p.v, p.groups, payload)
        check_amax(amax, p.groups.scope, p.groups.fp8_dtype)
        return None
    served = _host_lane(p, payload, crc_seed, k_bytes)
    if served is not None:
        return served.crc if crc_seed is not None else None
    k_dst, q_dst, s_dst = _sections(p, payload)
    scales = p.scales
    encode_kw = {"scale_dtype": to_torch(p.header.scale_dtype), "nonfinite": p.nonfinite, "out": q_dst}
    if q_dst is not None and scales is None and not p.fp8_given and k_dst is not None:
        scales = backends.call(p.backend, "encode_kv", p.k, k_dst, p.v, p.groups, **encode_kw)  # one pass
    else:
        if k_dst is not None:
            copy_tensor(k_dst, p.k)
        if q_dst is None:  # an empty chunk: the scales of nothing
            if scales is None:
                scales = torch.ones(p.header.scale_shape, dtype=encode_kw["scale_dtype"], device=p.v.device)
        elif p.fp8_given:
            copy_tensor(q_dst, p.v)
        elif scales is None:
            scales = backends.call(p.backend, "encode_v", p.v, p.groups, **encode_kw)
        else:
            backends.call(p.backend, "quantize", p.v, scales, p.groups, out=q_dst)
    if len(s_dst):
        copy_scale_bytes(s_dst, scales)
    return None


# ----------------------------------------------------------------------------
# Stage 3: seal
# ----------------------------------------------------------------------------


def seal(buf: memoryview, h: Header) -> int:
    """Pack ``h``'s header at the start of ``buf`` (payload already in place) with its CRC; return the blob size."""
    hs = pack_header_into(buf, h, 0)
    crc = payload_crc(h, buf[: hs - 4], (buf[hs : hs + h.payload_len],))
    buf[hs - 4 : hs] = crc.to_bytes(4, "little")
    return hs + h.payload_len


def _out_view(out: Any, size: int) -> memoryview:
    mv = as_bytes_view(out)
    if mv.readonly:
        raise UnsupportedConfigError(f"out is a read-only {type(out).__name__}", reason=Reason.BAD_OUTPUT)
    if len(mv) < size:
        raise UnsupportedConfigError(
            f"out holds {len(mv)} bytes; this blob needs {size}", reason=Reason.BAD_OUTPUT
        )
    return mv[:size]


def _refuse_overlap(p: EncodePlan, mv: memoryview) -> None:
    """Refuse an ``out`` whose bytes lie within K's, V's or the given scales' memory: the payload
    writes would overwrite inputs still to be read (and a blob could come out CRC-valid but wrong)."""
    base = buffer_address(mv) if len(mv) else 0  # once for every input
    for name, t in (("K", p.k), ("V", p.v), ("scales", p.scales)):
        if overlaps_buffer(t, mv, base):
            raise UnsupportedConfigError(
                f"out overlaps {name}'s memory; encode into a buffer of its own", reason=Reason.OVERLAP
            )


def _write_blob(
    p: EncodePlan,
    packer: HeaderPacker,
    spec: EncodeSpec,
    out: Any = None,
    *,
    crc: bool = True,
    k_bytes: bool = True,
    reuse: bool = False,
) -> tuple[Any, memoryview]:
    """Write the planned blob into ``out`` (or a new bytearray); return the owner and the blob's view.

    ``crc=False``: the CRC field left 0 and no CRC computed, for a blob only read back here with
    ``verify_crc=False`` (the plain blob the lossless stage codes: its own CRC is computed anew).
    ``k_bytes=False``: K's bytes may be left out of the blob (the lossless stage then codes K's planes,
    split where K lives: on a device, K never crosses twice; on the host, K is not copied first).
    ``reuse`` (with no ``out``): the blob written into this thread's reused payload buffer, for a plain
    blob the lossless stage reads once and drops (a fresh one per blob cost its page faults)."""
    hs = packer.size
    size = hs + p.header.payload_len
    owner = (
        out if out is not None else plain_scratch(size) if reuse else new_buffer(size)
    )  # all written below
    mv = _out_view(owner, size)
    if out is not None:
        _refuse_overlap(p, mv)
    value = None if crc else 0  # None: computed from the payload when the header is packed
    if p.v.device.type == "cpu":
        # The header first (its CRC field later): the payload's pass can then carry the CRC on from it.
        packer.pack_into(mv, layer_id=spec.layer_id, chunk_id=spec.chunk_id, crc=0)
        if crc:
            value = write_payload(p, mv[hs:], crc_seed=payload_crc(p.header, mv[: hs - 4], ()))
        else:
            write_payload(p, mv[hs:], k_bytes=k_bytes)
    else:
        dev_payload = torch.empty(p.header.payload_len, dtype=torch.uint8, device=p.v.device)
        write_payload(p, dev_payload)
        skip = 0 if k_bytes else p.header.k_payload_len
        torch.frombuffer(mv[hs + skip :], dtype=torch.uint8).copy_(dev_payload[skip:])
    packer.pack_into(mv, layer_id=spec.layer_id, chunk_id=spec.chunk_id, payload=mv[hs:], crc=value)
    return owner, mv


_PLANS: dict[tuple[Any, ...], tuple[Header, backends.Groups, backends.Backend, str, HeaderPacker]] = {}
"""Memoized layouts: header, grouping, backend, policy and header template (never the tensors)."""
_PLANS_MAX = 256


def _tensor_key(t: Any) -> tuple[Any, ...] | None:
    if (
        not isinstance(t, torch.Tensor)
        or t.is_nested
        or t.layout != torch.strided
        or t.is_neg()
        or t.is_conj()
    ):
        return None
    return (t.shape, t.stride(), t.dtype, t.device)


def _planned(k: Any, v: Any, spec: EncodeSpec) -> tuple[EncodePlan, HeaderPacker]:
    """The plan and header packer of an encode; memoized on everything but the tensors' values and the
    ids, since a connector encodes the same layout for every layer of every chunk."""
    layout = spec.cache_key()
    kk, vk = (None if k is None else _tensor_key(k)), _tensor_key(v)
    key = (
        None
        if layout is None or vk is None or (k is not None and kk is None)
        else (layout, kk, vk, os.environ.get("KVCODEC_BACKEND"), triton_interpret())
    )
    hit = _PLANS.get(key) if key is not None else None
    if hit is None:
        plan = plan_encode(k, v, spec)
        packer = HeaderPacker(plan.header)
        if key is not None and plan.scales is None and not plan.fp8_given:  # computed scales only (not raw)
            if len(_PLANS) >= _PLANS_MAX:
                _PLANS.clear()
            _PLANS[key] = (plan.header, plan.groups, plan.backend, plan.nonfinite, packer)
        return plan, packer
    _check_options(spec)  # cheap, and exact: a hit accepts nothing a fresh plan would refuse
    header, groups, backend, nonfinite, packer = hit
    ax = {"head_axis": spec.head_axis, "page_axis": spec.page_axis}
    k3 = None if k is None else normalize_layout(k, **ax)[0]
    plan = EncodePlan(header, k3, normalize_layout(v, **ax)[0], False, None, groups, backend, nonfinite)
    return plan, packer


def encode(k: Any, v: Any, spec: EncodeSpec | None = None, *, out: Any = None, **options: Any) -> Any:
    """Encode one layer's K and V of a chunk into an LMCKV blob.

    ``k``/``v`` are ``[tokens, heads, head_dim]`` or paged ``[pages, page_size,
    heads, head_dim]`` (other orders via ``head_axis``/``page_axis``); ``k``
    may be None for a V-only blob. Options are the fields of
    :class:`EncodeSpec`, given as ``spec`` or as keywords (keywords win).
    Returns header and payload in one new ``bytearray``; with ``out`` (any
    writable buffer of at least :func:`encoded_size` bytes) the blob is written
    there instead and a memoryview of its bytes is returned.
    """
    spec = EncodeSpec.of(spec, options)
    lossless = _lossless(spec, out)
    plan, packer = _planned(k, v, spec)
    planes = _k_planes(plan, spec) if lossless else None
    owner, mv = _write_blob(plan, packer, spec, out, crc=not lossless, k_bytes=planes is None, reuse=lossless)
    if lossless:  # the plain blob just written, as parsed (its header is the plan's, ids aside): no parse
        plain = ParsedBlob(plan.header, mv, packer.size, crc=0, trailing=0)
        return compress_blob(plain, k_planes=planes)
    return owner if out is None else mv


def _k_planes(plan: EncodePlan, spec: EncodeSpec) -> Planes | None:
    """K's byte planes for the lossless stage: split where K lives (a GPU; Triton's interpreter when
    named) and copied to the host, or split from a contiguous CPU K's own bytes (K is then never copied
    into the plain blob); None: the host splits the plain blob's K (any other K)."""
    if plan.k is None or not plan.k.numel():
        return None
    got = split_to_host(plan.k, backend=spec.backend)
    return got if got is not None else split_host(plan.k, to_torch(plan.header.k_dtype))


def _lossless(spec: EncodeSpec, out: Any) -> bool:
    """Whether ``spec`` asks for the lossless payload (refusing an unknown name, or it with ``out``)."""
    if spec.compression not in COMPRESSIONS:
        raise UnsupportedConfigError(
            f"compression={spec.compression!r}; expected one of {COMPRESSIONS}", reason=Reason.BAD_VALUE
        )
    if spec.compression == "none":
        return False
    if out is not None:
        raise UnsupportedConfigError(
            "compression='lossless' with out=: the coded size is known only once coded",
            reason=Reason.BAD_VALUE,
        )
    if spec.version < 2:
        raise UnsupportedConfigError(
            f"compression='lossless' needs version 2; got {spec.version} (LMCache's version 1 stays plain)",
            reason=Reason.BAD_VALUE,
        )
    return True


def encoded_size(k: Any, v: Any, spec: EncodeSpec | None = None, **options: Any) -> int:
    """Bytes the blob of ``encode(k, v, spec, **options)`` takes (nothing is computed from V's values)."""
    h = plan_encode(k, v, EncodeSpec.of(spec, options)).header
    return header_size(h) + h.payload_len


# ----------------------------------------------------------------------------
# Every layer of a chunk
# ----------------------------------------------------------------------------


def encode_layers(
    ks: Sequence[torch.Tensor | None] | torch.Tensor,
    vs: Sequence[torch.Tensor] | torch.Tensor,
    spec: EncodeSpec | None = None,
    *,
    layer_ids: Sequence[int] | None = None,
    **options: Any,
) -> list[bytearray]:
    """Encode every layer of a chunk: one blob per layer (stacked ``[L, ...]`` or lists).

    On the Triton backend all layers go through one fused launch and the
    headers come from one :class:`~kvcodec.format.HeaderPacker` template; the
    blobs are identical to per-layer :func:`encode` calls.
    """
    ks = ks if isinstance(ks, torch.Tensor) else list(ks)
    vs = vs if isinstance(vs, torch.Tensor) else list(vs)
    n = len(vs)
    if len(ks) != n:
        raise UnsupportedConfigError(f"{len(ks)} K layers but {n} V layers", reason=Reason.BAD_SHAPE)
    ids = (
        [int(_check_int("layer_ids[]", i, -1)) for i in layer_ids]
        if layer_ids is not None
        else list(range(n))
    )
    if len(ids) != n:
        raise UnsupportedConfigError(f"{len(ids)} layer_ids for {n} layers", reason=Reason.BAD_VALUE)
    base = EncodeSpec.of(spec, options)
    if _lossless(base, None):
        plain = encode_layers(ks, vs, base.replace(compression="none"), layer_ids=ids)
        return [compress_blob(parse(b, verify_crc=False)) for b in plain]
    if n > 1 and all(k is not None for k in ks):
        try:
            plan = plan_encode(ks[0], vs[0], base.replace(layer_id=ids[0]))
        except UnsupportedConfigError as e:
            raise UnsupportedConfigError(f"layer {ids[0]}: {e}", reason=e.reason) from None
        if plan.fusable:
            return _encode_layers_fused(plan, ks, vs, ids, base)  # type: ignore[arg-type]
    return [encode(ks[i], vs[i], base.replace(layer_id=ids[i])) for i in range(n)]


def _same_layers(ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]) -> None:
    for i in range(len(vs)):
        if vs[i].shape != vs[0].shape or ks[i].shape != ks[0].shape:
            raise UnsupportedConfigError(
                f"layer {i} has K {tuple(ks[i].shape)} / V {tuple(vs[i].shape)}; layer 0 has "
                f"{tuple(ks[0].shape)} / {tuple(vs[0].shape)}",
                reason=Reason.BAD_SHAPE,
            )
        if ks[i].dtype != ks[0].dtype or vs[i].dtype != vs[0].dtype:
            raise UnsupportedConfigError(
                f"layer {i} dtypes differ from layer 0's", reason=Reason.UNSUPPORTED_DTYPE
            )


def _encode_layers_fused(
    plan: EncodePlan, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], ids: list[int], spec: EncodeSpec
) -> list[bytearray]:
    """All layers in one Triton launch; layer 0's plan validated the arguments and gives the header."""
    _same_layers(ks, vs)
    ax = {"head_axis": spec.head_axis, "page_axis": spec.page_axis}
    k3s = [normalize_layout(x, **ax)[0] for x in ks]
    v3s = [normalize_layout(x, **ax)[0] for x in vs]
    h0 = plan.header
    payloads = plan.backend.empty_payloads(len(v3s), h0.payload_len, plan.v.device)
    amax = plan.backend.encode_fused_layers(k3s, v3s, plan.groups, payloads)
    check_layers_amax(amax, plan.groups.scope, plan.groups.fp8_dtype, ids)
    host = payloads.cpu()
    packer = HeaderPacker(h0)
    blobs = []
    for j in range(len(v3s)):
        out = new_buffer(packer.size + h0.payload_len)
        mv = memoryview(out)
        torch.frombuffer(mv[packer.size :], dtype=torch.uint8).copy_(host[j])
        packer.pack_into(mv, layer_id=ids[j], chunk_id=h0.chunk_id, payload=mv[packer.size :])
        blobs.append(out)
    return blobs

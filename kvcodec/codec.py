"""Encode K/V tensors into LMCKV blobs and decode them back, shapes restored.

K is copied bit-exact at its own dtype; V is quantized to FP8 with the
numerics of :mod:`kvcodec.quant` (LMCache's). Encode writes header and payload
into one buffer, with no intermediate ``bytes``; decode builds tensors over the
caller's buffer (zero-copy on CPU when the buffer is writable).
"""

from __future__ import annotations

import math
import os
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from . import native, quant
from .crc import crc32
from .errors import CodecMismatchError, CorruptEncodedKVError, UnsupportedConfigError
from .format import (
    HASH_KEYS,
    Hashes,
    Header,
    ParsedBlob,
    ScaleScheme,
    ScaleScope,
    check_crc,
    header_size,
    pack_header_into,
    parse,
    payload_crc,
)

__all__ = [
    "BACKENDS",
    "DecodedKV",
    "Layout",
    "check_hashes",
    "decode",
    "decode_parsed",
    "encode",
    "encode_layers",
    "normalize_layout",
    "resolve_backend",
    "resolve_scope",
]

# torch warns that a tensor over a read-only buffer is writable; kvcodec only
# reads such views (or clones them at once). A filter scoped to this message and
# to kvcodec's modules, set once: catch_warnings() per call is not thread-safe.
warnings.filterwarnings(
    "ignore", message="The given buffer is not writable", category=UserWarning, module=r"kvcodec(\.|$)"
)

BACKENDS = ("auto", "torch", "native", "triton")
KDTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""K dtypes copied bit-exact (fp16/bf16 are the point; fp32 is accepted as LMCache does)."""
VDTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCALE_DTYPES = (torch.float32, torch.float16)

ScopeLike = ScaleScope | int | str
_COMPUTED = (ScaleScope.PER_TENSOR, ScaleScope.PER_LAYER_HEAD, ScaleScope.PER_PAGE_HEAD)


class DecodedKV(NamedTuple):
    """What :func:`decode` returns."""

    k: torch.Tensor | None
    """K ``[tokens, heads, head_dim]`` at its stored dtype (None if the blob holds no K)."""
    v: torch.Tensor
    """V: raw FP8, or dequantized to the requested dtype, ``[tokens, heads, head_dim]``."""
    scales: torch.Tensor | None
    """V's scales as stored (scale_shape); None for external scopes without given scales."""
    header: Header


@dataclass(frozen=True)
class Layout:
    """How a tensor maps onto token-major ``[tokens, heads, head_dim]``."""

    tokens: int
    heads: int
    head_dim: int
    page_size: int | None
    """Tokens per page when the input was paged (or pages were named), else None."""


# ----------------------------------------------------------------------------
# Argument helpers
# ----------------------------------------------------------------------------

_SCOPE_ALIASES = {
    "per_tensor": ScaleScope.PER_TENSOR,
    "tensor": ScaleScope.PER_TENSOR,
    "per_layer_head": ScaleScope.PER_LAYER_HEAD,
    "layer_head": ScaleScope.PER_LAYER_HEAD,
    "per_page_head": ScaleScope.PER_PAGE_HEAD,
    "page_head": ScaleScope.PER_PAGE_HEAD,
    "external": ScaleScope.EXTERNAL,
    "none": ScaleScope.NONE,
    "raw": ScaleScope.NONE,
}


def resolve_scope(scope: ScopeLike) -> ScaleScope:
    """A :class:`ScaleScope` from an enum, its value, or a name like ``"per_page_head"``."""
    if isinstance(scope, ScaleScope):
        return scope
    if isinstance(scope, str):
        try:
            return _SCOPE_ALIASES[scope.lower()]
        except KeyError:
            raise UnsupportedConfigError(
                f"unknown scale scope {scope!r}; expected one of {sorted(_SCOPE_ALIASES)}"
            ) from None
    try:
        return ScaleScope(int(scope))
    except (ValueError, TypeError):
        raise UnsupportedConfigError(f"unknown scale scope {scope!r}") from None


def _triton_usable(device: torch.device) -> bool:
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend(backend: str | None, device: torch.device | str) -> str:
    """Pick "torch", "native" or "triton" for ``device``.

    ``None`` reads ``KVCODEC_BACKEND`` (default "auto"). "auto" takes Triton on
    CUDA when it is installed, the C loops of :mod:`kvcodec.native` on CPU when
    they are built, and the torch reference otherwise (on CPU Triton only runs
    in its slow interpreter, for correctness tests). An explicit backend that
    cannot run on ``device`` raises :class:`UnsupportedConfigError`.
    """
    device = torch.device(device)
    b = (backend or os.environ.get("KVCODEC_BACKEND") or "auto").lower()
    if b not in BACKENDS:
        raise UnsupportedConfigError(f"unknown backend {b!r}; expected one of {BACKENDS}")
    if b == "auto":
        if device.type == "cuda":
            return "triton" if _triton_usable(device) else "torch"
        return "native" if device.type == "cpu" and native.AVAILABLE else "torch"
    if b == "triton" and not _triton_usable(device):
        raise UnsupportedConfigError(
            f"backend 'triton' cannot run on {device}: it needs a CUDA device with triton "
            "installed, or CPU tensors with TRITON_INTERPRET=1"
        )
    if b == "native" and (device.type != "cpu" or not native.AVAILABLE):
        raise UnsupportedConfigError(
            f"backend 'native' cannot run on {device}: it needs CPU tensors and the kvcodec._cpu "
            f"extension ({'built' if native.AVAILABLE else 'not built: reinstall with a C compiler'})"
        )
    return b


def _impl(backend: str) -> Any:
    if backend == "triton":
        from .kernels import quant_triton

        return quant_triton
    if backend == "native":
        return native
    return quant


def _norm_axis(axis: int, ndim: int, name: str) -> int:
    if not -ndim <= axis < ndim:
        raise UnsupportedConfigError(f"{name}={axis} out of range for a {ndim}-D tensor")
    return axis % ndim


def normalize_layout(
    x: torch.Tensor, *, head_axis: int | None = None, page_axis: int | None = None
) -> tuple[torch.Tensor, Layout]:
    """View ``x`` as token-major ``[tokens, heads, head_dim]``.

    Accepts ``[tokens, heads, head_dim]``, paged ``[pages, page_size, heads,
    head_dim]``, or any 3-D/4-D order named by ``head_axis`` (and ``page_axis``
    for 4-D; in 3-D a ``page_axis`` means one page per index). head_dim is the
    last axis. No copy is made where a view is possible.
    """
    nd = x.dim()
    if nd not in (3, 4):
        raise UnsupportedConfigError(
            f"expected a 3-D [tokens, heads, head_dim] or 4-D [pages, page_size, heads, head_dim] "
            f"tensor; got shape {tuple(x.shape)}"
        )
    h_ax = _norm_axis(-2 if head_axis is None else head_axis, nd, "head_axis")
    if h_ax == nd - 1:
        raise UnsupportedConfigError(f"head_axis={head_axis} names the last axis, which is head_dim")
    p_ax = None if page_axis is None else _norm_axis(page_axis, nd, "page_axis")
    if p_ax is not None and p_ax in (h_ax, nd - 1):
        raise UnsupportedConfigError(
            f"page_axis={page_axis} collides with head_axis={head_axis} or head_dim (last axis)"
        )
    rest = [a for a in range(nd - 1) if a != h_ax]
    if nd == 3:
        (t_ax,) = rest
        if p_ax is not None and p_ax != t_ax:
            raise UnsupportedConfigError(f"page_axis={page_axis} is not the token axis {t_ax}")
        y = x.permute(t_ax, h_ax, nd - 1)
        return y, Layout(y.shape[0], y.shape[1], y.shape[2], 1 if p_ax is not None else None)
    if p_ax is None:
        p_ax = rest[0]
    (s_ax,) = [a for a in rest if a != p_ax]
    y = x.permute(p_ax, s_ax, h_ax, nd - 1)
    pages, ps, heads, dim = y.shape
    y = y.reshape(pages * ps, heads, dim)
    return y, Layout(pages * ps, heads, dim, ps)


def check_hashes(got: Hashes, expected: Any, *, strict: bool = False) -> None:
    """Refuse a blob whose identity hashes differ from ``expected``.

    Empty strings are wildcards on either side, as in LMCache. With
    ``strict``, a non-empty expected value must also be present in the blob.
    """
    exp = Hashes.coerce(expected)
    for key in HASH_KEYS:
        ev, gv = getattr(exp, key), getattr(got, key)
        if not ev:
            continue
        if gv and gv != ev:
            raise CodecMismatchError(f"codec hash mismatch on {key!r}: encoded={gv!r}, expected={ev!r}")
        if not gv and strict:
            raise CodecMismatchError(
                f"codec hash {key!r} missing from the blob (strict): expected={ev!r}, encoded=''"
            )


# ----------------------------------------------------------------------------
# Encode
# ----------------------------------------------------------------------------


def _check_fp8(v_dtype: torch.dtype, allow_e5m2: bool) -> None:
    if v_dtype == torch.float8_e5m2 and not allow_e5m2:
        raise UnsupportedConfigError("float8_e5m2 V is opt-in: pass allow_e5m2=True")
    if v_dtype not in quant.FP8_DTYPES:
        raise UnsupportedConfigError(f"v_dtype must be float8_e4m3fn or float8_e5m2; got {v_dtype}")


def _seal(buf: memoryview, h: Header) -> int:
    """Write ``h``'s header at the start of ``buf`` (payload already in place), CRC included."""
    hs = pack_header_into(buf, h, 0)
    crc = payload_crc(h, buf[: hs - 4], (buf[hs : hs + h.payload_len],))
    struct.pack_into("<I", buf, hs - 4, crc)
    return hs


@dataclass
class _Plan:
    """A validated encode: the header to write and what fills the payload."""

    header: Header
    k3: torch.Tensor | None
    v3: torch.Tensor
    q_src: torch.Tensor | None
    v_scales: torch.Tensor | None
    quant_scope: ScaleScope
    sc: ScaleScope
    ps: int | None
    be: str
    impl: Any
    device: torch.device
    nonfinite: quant.NonFinitePolicy

    @property
    def fusable(self) -> bool:
        """Whether one fused Triton launch can write K, FP8 V and the scales."""
        h = self.header
        return (
            self.be == "triton"
            and self.v_scales is None
            and self.k3 is not None
            and h.k_dtype in (torch.float16, torch.bfloat16)
            and h.v_payload_len > 0
            and h.scale_dtype == torch.float32
            and self.nonfinite == "error"
        )


def encode(
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    *,
    scope: ScopeLike = ScaleScope.PER_PAGE_HEAD,
    page_size: int | None = None,
    head_axis: int | None = None,
    page_axis: int | None = None,
    hashes: Any = None,
    layer_id: int = -1,
    chunk_id: int = -1,
    chunk_size: int | None = None,
    kv_head_count: int | None = None,
    head_dim: int | None = None,
    v_dtype: torch.dtype = torch.float8_e4m3fn,
    allow_e5m2: bool = False,
    scale_dtype: torch.dtype = torch.float32,
    scales: torch.Tensor | float | None = None,
    precomputed_v_quant: torch.Tensor | None = None,
    precomputed_v_scales: torch.Tensor | None = None,
    nonfinite: quant.NonFinitePolicy = "error",
    version: int = 1,
    store_scales: bool | None = None,
    backend: str | None = None,
) -> bytearray:
    """Encode one layer's K and V of a chunk into an LMCKV blob.

    ``k``/``v`` share a layout (see :func:`normalize_layout`); ``k`` may be
    None for a V-only blob. ``scope`` is a :class:`ScaleScope` or a name
    ("per_tensor", "per_layer_head", "per_page_head", "external", "raw").
    ``external`` quantizes with caller ``scales`` and stores none; ``raw``
    writes unit-scale FP8 in a version-2 header. ``store_scales=True`` keeps an
    external scope's scales in the payload too (as LMCache does with attached
    scales). Layout fields left None are filled from the tensors. Returns header
    and payload in one ``bytearray``.
    """
    plan = _plan_encode(
        k,
        v,
        scope=scope,
        page_size=page_size,
        head_axis=head_axis,
        page_axis=page_axis,
        hashes=hashes,
        layer_id=layer_id,
        chunk_id=chunk_id,
        chunk_size=chunk_size,
        kv_head_count=kv_head_count,
        head_dim=head_dim,
        v_dtype=v_dtype,
        allow_e5m2=allow_e5m2,
        scale_dtype=scale_dtype,
        scales=scales,
        precomputed_v_quant=precomputed_v_quant,
        precomputed_v_scales=precomputed_v_scales,
        nonfinite=nonfinite,
        version=version,
        store_scales=store_scales,
        backend=backend,
    )
    return _write_blob(plan)


def _plan_encode(
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    *,
    scope: ScopeLike = ScaleScope.PER_PAGE_HEAD,
    page_size: int | None = None,
    head_axis: int | None = None,
    page_axis: int | None = None,
    hashes: Any = None,
    layer_id: int = -1,
    chunk_id: int = -1,
    chunk_size: int | None = None,
    kv_head_count: int | None = None,
    head_dim: int | None = None,
    v_dtype: torch.dtype = torch.float8_e4m3fn,
    allow_e5m2: bool = False,
    scale_dtype: torch.dtype = torch.float32,
    scales: torch.Tensor | float | None = None,
    precomputed_v_quant: torch.Tensor | None = None,
    precomputed_v_scales: torch.Tensor | None = None,
    nonfinite: quant.NonFinitePolicy = "error",
    version: int = 1,
    store_scales: bool | None = None,
    backend: str | None = None,
) -> _Plan:
    """Validate encode's arguments and lay out the blob: everything short of writing it."""
    sc = resolve_scope(scope)
    _check_fp8(v_dtype, allow_e5m2)
    if scale_dtype not in SCALE_DTYPES:
        raise UnsupportedConfigError(f"scale_dtype must be float32 or float16; got {scale_dtype}")
    scheme = ScaleScheme.COMPUTED
    if sc == ScaleScope.NONE:
        scheme = ScaleScheme.UNIT
        version = max(version, 2)
    if version not in (1, 2):
        raise UnsupportedConfigError(f"header version must be 1 or 2; got {version}")

    src = v if v is not None else precomputed_v_quant
    if src is None:
        raise UnsupportedConfigError("encode needs v, or precomputed_v_quant with its scales")
    v3, lay = normalize_layout(src, head_axis=head_axis, page_axis=page_axis)
    k3 = None
    if k is not None:
        if tuple(k.shape) != tuple(src.shape):
            raise UnsupportedConfigError(
                f"encode: K and V shapes must match; got K={tuple(k.shape)} vs V={tuple(src.shape)}"
            )
        if k.dtype not in KDTYPES:
            raise UnsupportedConfigError(f"K dtype must be float16, bfloat16 or float32; got {k.dtype}")
        if k.device != src.device:
            raise UnsupportedConfigError(f"K is on {k.device} but V on {src.device}")
        k3, _ = normalize_layout(k, head_axis=head_axis, page_axis=page_axis)
    if v is not None and precomputed_v_quant is None and v.dtype not in VDTYPES:
        raise UnsupportedConfigError(f"V dtype must be float16, bfloat16 or float32; got {v.dtype}")
    tokens, heads, dim = lay.tokens, lay.heads, lay.head_dim
    ps = page_size if page_size is not None else lay.page_size
    if ps is not None and ps < 1:
        raise UnsupportedConfigError(f"page_size must be >= 1; got {ps}")
    for name, given, actual in (("kv_head_count", kv_head_count, heads), ("head_dim", head_dim, dim)):
        if given is not None and given not in (-1, actual):
            raise UnsupportedConfigError(f"{name}={given} but the tensors have {actual}")
    if chunk_size is not None and chunk_size != -1 and chunk_size < tokens:
        raise UnsupportedConfigError(f"chunk_size={chunk_size} is smaller than the {tokens} tokens given")

    device = v3.device
    be = resolve_backend(backend, device)
    impl = _impl(be)

    # --- V's scales and FP8 bytes --------------------------------------------------
    computed = sc in _COMPUTED
    if store_scales is None or sc == ScaleScope.NONE:
        store_scales = computed
    elif computed and not store_scales:
        raise UnsupportedConfigError(f"scope {sc.name} always stores its scales")
    q_src: torch.Tensor | None = None
    quant_scope = sc
    if precomputed_v_quant is not None:
        if precomputed_v_scales is None and sc not in (ScaleScope.NONE,):
            raise UnsupportedConfigError("encode: precomputed_v_quant requires precomputed_v_scales")
        if precomputed_v_quant.dtype != v_dtype:
            raise UnsupportedConfigError(
                f"encode: precomputed_v_quant dtype {precomputed_v_quant.dtype} != codec {v_dtype}"
            )
        if v is not None and tuple(precomputed_v_quant.shape) != tuple(v.shape):
            raise UnsupportedConfigError(
                f"precomputed_v_quant shape {tuple(precomputed_v_quant.shape)} != V {tuple(v.shape)}"
            )
        q_src, _ = normalize_layout(precomputed_v_quant, head_axis=head_axis, page_axis=page_axis)
        v_scales = precomputed_v_scales
        if sc == ScaleScope.NONE:
            v_scales = torch.ones((), dtype=torch.float32, device=device)  # raw FP8 passes through
        elif v_scales is not None:
            v_scales = _as_scales(v_scales, device, scale_dtype)
            if sc == ScaleScope.EXTERNAL:
                quant_scope = _external_scope(v_scales, heads)
            if computed or sc == ScaleScope.EXTERNAL:
                want = quant.scale_shape(quant_scope, tokens, heads, ps)
                if tuple(v_scales.shape) != want:
                    raise UnsupportedConfigError(
                        f"precomputed_v_scales shape {tuple(v_scales.shape)} does not fit scope "
                        f"{sc.name} over {tokens} tokens x {heads} heads (page_size {ps}); expected {want}"
                    )
    elif sc == ScaleScope.NONE:
        v_scales = torch.ones((), dtype=torch.float32, device=device)
        quant_scope = ScaleScope.PER_TENSOR
    elif sc == ScaleScope.EXTERNAL:
        if scales is None:
            raise UnsupportedConfigError("scope external needs the caller's scales (scales=...)")
        v_scales = _as_scales(scales, device, scale_dtype)
        quant_scope = _external_scope(v_scales, heads)
        if quant_scope == ScaleScope.PER_PAGE_HEAD and ps is None:
            raise UnsupportedConfigError("external (pages, heads) scales need page_size")
    else:
        if sc == ScaleScope.PER_PAGE_HEAD and ps is None:
            raise UnsupportedConfigError(
                "per_page_head needs page_size= or a paged [pages, page_size, heads, head_dim] input"
            )
        if scales is not None:
            raise UnsupportedConfigError("scales= is for scope external; use precomputed_v_scales")
        v_scales = None  # computed with the FP8 bytes, below

    if v_scales is None:
        scale_shape = quant.scale_shape(sc, tokens, heads, ps)
    else:
        scale_shape = tuple(v_scales.shape) if (computed or sc == ScaleScope.EXTERNAL) else ()
    n_scales = math.prod(scale_shape) if store_scales else 0
    k_dtype = k3.dtype if k3 is not None else torch.float16
    elems = tokens * heads * dim
    k_len = elems * k_dtype.itemsize if k3 is not None else 0
    s_len = n_scales * scale_dtype.itemsize
    header = Header(
        k_dtype=k_dtype,
        v_dtype=v_dtype,
        scale_dtype=scale_dtype,
        scale_scope=sc,
        version=version,
        scale_scheme=scheme,
        layer_id=layer_id,
        chunk_id=chunk_id,
        chunk_size=tokens if chunk_size is None else chunk_size,
        page_size=-1 if ps is None else ps,
        kv_head_count=heads if kv_head_count is None else kv_head_count,
        head_dim=dim if head_dim is None else head_dim,
        scale_shape=scale_shape,
        k_payload_len=k_len,
        v_payload_len=elems,
        scale_payload_len=s_len,
        hashes=Hashes.coerce(hashes),
    )
    return _Plan(
        header=header, k3=k3, v3=v3, q_src=q_src, v_scales=v_scales, quant_scope=quant_scope,
        sc=sc, ps=ps, be=be, impl=impl, device=device, nonfinite=nonfinite,
    )  # fmt: skip


def _write_blob(p: _Plan) -> bytearray:
    """Fill one buffer with the planned header and payload (K, FP8 V, scales) and seal it."""
    header, k3, v3, q_src, v_scales = p.header, p.k3, p.v3, p.q_src, p.v_scales
    sc, ps, impl, device, nonfinite, quant_scope = p.sc, p.ps, p.impl, p.device, p.nonfinite, p.quant_scope
    k_dtype, v_dtype, scale_dtype = header.k_dtype, header.v_dtype, header.scale_dtype
    tokens, heads, dim = v3.shape
    k_len, elems, s_len = header.k_payload_len, header.v_payload_len, header.scale_payload_len
    hs = header_size(header)
    # Every byte is written below (header, K, V, scales), so no zero-fill.
    out = native.empty_bytearray(hs + header.payload_len)
    mv = memoryview(out)
    v_off, s_off = hs + k_len, hs + k_len + elems
    if device.type == "cpu":
        # Write straight into the blob (sections may sit at odd addresses:
        # frombuffer over each slice handles that, a dtype view would not).
        k_dst = torch.frombuffer(mv[hs:v_off], dtype=k_dtype) if k_len else None
        q_dst = torch.frombuffer(mv[v_off:s_off], dtype=v_dtype) if elems else None
        s_dst = torch.frombuffer(mv[s_off:], dtype=torch.uint8) if s_len else None
        dev_payload = None
    else:
        dev_payload = torch.empty(header.payload_len, dtype=torch.uint8, device=device)
        k_dst = dev_payload[:k_len].view(k_dtype) if k_len else None
        q_dst = dev_payload[k_len : k_len + elems].view(v_dtype) if elems else None
        s_dst = dev_payload[k_len + elems :] if s_len else None

    if (
        p.be == "native"
        and v_scales is None
        and q_src is None
        and scale_dtype == torch.float32
        and nonfinite == "error"
        and k_dst is not None
        and q_dst is not None
        and s_dst is not None
        and native.can_encode_fused(k3, v3, sc, v_dtype, ps)
    ):
        # K, V's codes, the scales and the CRC in one C call (two threads).
        crc_off = pack_header_into(mv, header, 0) - 4
        status, crc = native.encode_chunk(
            k3, v3, sc, ps, k_dst, q_dst, s_dst, payload_crc(header, mv[:crc_off], ())
        )
        if status == -1:
            struct.pack_into("<I", mv, crc_off, crc)
            return out
        k_dst = None  # K is in place; the reference redoes V (and raises for NaN/Inf)
    if p.fusable:
        # One launch writes K, the FP8 bytes and the scales into the payload.
        payload = dev_payload if dev_payload is not None else torch.frombuffer(mv[hs:], dtype=torch.uint8)
        amax = impl.encode_fused(k3, v3, sc, page_size=ps, fp8_dtype=v_dtype, payload=payload)
        quant.check_finite_amax(amax, sc)
        k_dst = q_dst = s_dst = None
        v_scales = amax  # only its shape is used below
    if k_dst is not None and k3 is not None:
        k_dst.view(tokens, heads, dim).copy_(k3)
    if q_dst is not None:
        q_out = q_dst.view(tokens, heads, dim)
        if q_src is not None:
            q_out.copy_(q_src)
        elif v_scales is None:
            v_scales = _encode_v(impl, v3, sc, ps, v_dtype, scale_dtype, nonfinite, q_out)
        else:
            impl.quantize(v3, v_scales, quant_scope, page_size=ps, fp8_dtype=v_dtype, out=q_out)
    if v_scales is None:  # an empty chunk: scales of nothing
        v_scales = quant.compute_scales(v3, sc, page_size=ps, fp8_dtype=v_dtype).to(scale_dtype)
    if s_dst is not None:
        s_dst.copy_(v_scales.contiguous().view(-1).view(torch.uint8))
    if dev_payload is not None:
        torch.frombuffer(mv[hs:], dtype=torch.uint8).copy_(dev_payload)
    _seal(mv, header)
    return out


def _encode_v(
    impl: Any,
    v3: torch.Tensor,
    scope: ScaleScope,
    ps: int | None,
    v_dtype: torch.dtype,
    scale_dtype: torch.dtype,
    nonfinite: quant.NonFinitePolicy,
    out: torch.Tensor,
) -> torch.Tensor:
    """Scales (as stored) and FP8 bytes of V with the backend's kernels.

    Quantization uses the scales after their cast to ``scale_dtype``, as LMCache does.
    """
    scales = impl.compute_scales(v3, scope, page_size=ps, fp8_dtype=v_dtype, nonfinite=nonfinite)
    scales = quant.narrow_scales(scales, scale_dtype, scope)
    impl.quantize(v3, scales, scope, page_size=ps, fp8_dtype=v_dtype, out=out)
    return scales


def _external_scope(scales: torch.Tensor, heads: int) -> ScaleScope:
    if scales.dim() == 0 or (scales.dim() == 1 and scales.shape[0] == 1 and heads != 1):
        return ScaleScope.PER_TENSOR
    if scales.dim() == 1 and scales.shape[0] == heads:
        return ScaleScope.PER_LAYER_HEAD
    if scales.dim() == 2 and scales.shape[1] == heads:
        return ScaleScope.PER_PAGE_HEAD
    raise UnsupportedConfigError(
        f"external scales of shape {tuple(scales.shape)} fit no scope: expected (), ({heads},) "
        f"or (pages, {heads})"
    )


_FUSED_LAYER_KWARGS = frozenset(
    {"scope", "page_size", "head_axis", "page_axis", "hashes", "chunk_id", "chunk_size",
     "v_dtype", "allow_e5m2", "version", "backend"}
)  # fmt: skip


def encode_layers(
    ks: Sequence[torch.Tensor | None] | torch.Tensor,
    vs: Sequence[torch.Tensor] | torch.Tensor,
    *,
    layer_ids: Sequence[int] | None = None,
    **kwargs: Any,
) -> list[bytearray]:
    """Encode every layer of a chunk: one blob per layer (stacked ``[L, ...]`` or lists).

    On the Triton backend all layers go through one fused launch and the
    headers come from one :class:`~kvcodec.format.HeaderPacker` template; the
    blobs are identical to per-layer :func:`encode` calls (options the fused
    kernel lacks, e.g. fp16 scales or nonfinite="saturate", take that path).
    """
    n = len(vs)
    if len(ks) != n:
        raise UnsupportedConfigError(f"{len(ks)} K layers but {n} V layers")
    ids = list(layer_ids) if layer_ids is not None else list(range(n))
    if len(ids) != n:
        raise UnsupportedConfigError(f"{len(ids)} layer_ids for {n} layers")
    if n > 1 and set(kwargs) <= _FUSED_LAYER_KWARGS and all(k is not None for k in ks):
        try:
            plan = _plan_encode(ks[0], vs[0], layer_id=ids[0], **kwargs)
        except UnsupportedConfigError as e:
            raise UnsupportedConfigError(f"layer {ids[0]}: {e}") from None
        if plan.fusable:
            return _encode_layers_fused(plan, ks, vs, ids, kwargs)  # type: ignore[arg-type]
    return [encode(ks[i], vs[i], layer_id=ids[i], **kwargs) for i in range(n)]


def _encode_layers_fused(
    plan: _Plan, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], ids: list[int], kw: dict[str, Any]
) -> list[bytearray]:
    """All layers in one Triton launch; layer 0's plan validated the arguments and gives the header."""
    from .format import HeaderPacker

    h0 = plan.header
    ha, pa = kw.get("head_axis"), kw.get("page_axis")
    k3s, v3s = [], []
    for i in range(len(vs)):
        if vs[i].shape != vs[0].shape or ks[i].shape != ks[0].shape:
            raise UnsupportedConfigError(
                f"layer {i} has K {tuple(ks[i].shape)} / V {tuple(vs[i].shape)}; layer 0 has "
                f"{tuple(ks[0].shape)} / {tuple(vs[0].shape)}"
            )
        if ks[i].dtype != ks[0].dtype or vs[i].dtype != vs[0].dtype:
            raise UnsupportedConfigError(f"layer {i} dtypes differ from layer 0's")
        k3s.append(normalize_layout(ks[i], head_axis=ha, page_axis=pa)[0])
        v3s.append(normalize_layout(vs[i], head_axis=ha, page_axis=pa)[0])
    payloads = torch.empty((len(v3s), h0.payload_len), dtype=torch.uint8, device=plan.device)
    amax = plan.impl.encode_fused_layers(
        k3s, v3s, plan.sc, page_size=plan.ps, fp8_dtype=h0.v_dtype, payloads=payloads
    )
    bad = ~torch.isfinite(amax.reshape(len(v3s), -1)).all(dim=1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        try:
            quant.check_finite_amax(amax[i], plan.sc)
        except UnsupportedConfigError as e:
            raise UnsupportedConfigError(f"layer {ids[i]}: {e}") from None
    host = payloads.cpu() if plan.device.type != "cpu" else payloads
    packer = HeaderPacker(h0)
    blobs = []
    for j in range(len(v3s)):
        out = bytearray(packer.size + h0.payload_len)
        mv = memoryview(out)
        torch.frombuffer(mv[packer.size :], dtype=torch.uint8).copy_(host[j])
        packer.pack_into(mv, layer_id=ids[j], chunk_id=h0.chunk_id, payload=mv[packer.size :])
        blobs.append(out)
    return blobs


# ----------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------


def _view(mv: memoryview, dtype: torch.dtype, copy: bool, *, transient: bool = False) -> torch.Tensor:
    """A tensor over ``mv``'s bytes: a view when allowed, else one copy.

    A read-only buffer is copied, since a tensor cannot be read-only, unless
    ``transient``: the caller only reads the view before dropping it.
    """
    if len(mv) == 0:
        return torch.empty(0, dtype=dtype)
    if mv.readonly:
        t = torch.frombuffer(mv, dtype=torch.uint8)  # its "not writable" warning is filtered below
        return (t if transient and not copy else t.clone()).view(dtype)
    t = torch.frombuffer(mv, dtype=torch.uint8)
    return (t.clone() if copy else t).view(dtype)


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
    place (any strides, e.g. a connector's buffers); ``out_v``'s dtype picks raw
    or dequantized V when ``out_v_dtype`` is not given. On CPU, K and raw V are
    views into ``blob`` when it is writable and ``copy`` is False. ``scales``
    supplies an external scope's scales; ``shape`` = (tokens, heads, head_dim)
    for blobs whose writer left the layout fields unset (LMCache's default).
    """
    k_copy: memoryview | None = None
    if isinstance(blob, ParsedBlob):
        parsed, payload = blob, blob.payload
    else:
        on_cpu = out_k is None and out_v is None and (device is None or torch.device(device).type == "cpu")
        fused = verify_crc and on_cpu and native.AVAILABLE
        try:
            parsed = parse(blob, verify_crc=verify_crc and not fused, strict=strict)
        except CorruptEncodedKVError:
            if fused:  # report what a parse with its CRC check reports first
                parse(blob, strict=strict)
            raise
        payload = parsed.payload
        if fused:
            # Verify the CRC here instead: a read-only blob is copied out in the
            # same pass (K and V then become views of the copy, not copies again).
            h = parsed.header
            init = payload_crc(h, parsed.crc_prefix, ())
            dequant = out_v_dtype is not None and out_v_dtype != h.v_dtype
            if (payload.readonly or copy) and dequant:
                # V is only read (dequantized into a new tensor): copy K alone.
                k_copy = memoryview(native.empty_bytearray(h.k_payload_len))
                crc = native.copy_crc(k_copy, payload[: h.k_payload_len], init)
                check_crc(h, parsed.crc, crc32(payload[h.k_payload_len :], crc))
            elif payload.readonly or copy:
                own = memoryview(native.empty_bytearray(len(payload)))
                check_crc(h, parsed.crc, native.copy_crc(own, payload, init))
                payload, copy = own, False
            else:
                check_crc(h, parsed.crc, crc32(payload, init))
    if expected_hashes is not None:
        check_hashes(parsed.header.hashes, expected_hashes, strict=strict_hashes)
    return decode_parsed(
        parsed.header,
        payload,
        out_v_dtype=out_v_dtype,
        device=device,
        scales=scales,
        out_k=out_k,
        out_v=out_v,
        shape=shape,
        copy=copy,
        backend=backend,
        _k_copy=k_copy,
    )


def _as_scales(scales: Any, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Caller scales (tensor, float, numpy) as a tensor of the blob's scale dtype."""
    try:
        return torch.as_tensor(scales).to(device=device, dtype=dtype)
    except (TypeError, ValueError, RuntimeError) as e:
        raise UnsupportedConfigError(f"scales must be a tensor or a number; got {type(scales).__name__}: {e}") from None


def _into(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """Copy ``src`` into a caller buffer of the same element count, any shape or strides."""
    if dst.numel() != src.numel():
        raise UnsupportedConfigError(f"{what} has shape {tuple(dst.shape)}; the blob's is {tuple(src.shape)}")
    dst.copy_(src if dst.shape == src.shape else src.reshape(dst.shape))


def decode_parsed(
    h: Header,
    payload: memoryview,
    *,
    out_v_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    scales: torch.Tensor | float | None = None,
    out_k: torch.Tensor | None = None,
    out_v: torch.Tensor | None = None,
    copy: bool = False,
    backend: str | None = None,
    shape: tuple[int, int, int] | None = None,
    _k_copy: memoryview | None = None,
) -> DecodedKV:
    """Decode from a header and its payload view (see :func:`decode`).

    ``_k_copy`` (internal): K's bytes already copied out of a read-only payload.

    Without layout fields and without ``shape``, K and V come back flat; they
    can still be dequantized where the scope needs no layout (per tensor, unit).
    """
    dev = torch.device(device) if device is not None else (
        out_v.device if out_v is not None else out_k.device if out_k is not None else torch.device("cpu")
    )
    if h.v_dtype not in quant.FP8_DTYPES:
        raise UnsupportedConfigError(f"blob's V dtype {h.v_dtype} is not FP8; this codec writes FP8 V")
    if out_v is not None:
        if out_v_dtype is None:
            out_v_dtype = out_v.dtype
        elif out_v_dtype != out_v.dtype:
            raise UnsupportedConfigError(f"out_v is {out_v.dtype} but out_v_dtype={out_v_dtype}")
    raw_v = out_v_dtype is None or out_v_dtype == h.v_dtype
    if not raw_v and out_v_dtype not in VDTYPES:
        raise UnsupportedConfigError(
            f"V decodes to raw {h.v_dtype} or to float16, bfloat16 or float32; got {out_v_dtype}"
        )
    k_len, v_len = h.k_payload_len, h.v_payload_len
    n = v_len // h.v_dtype.itemsize
    if shape is None:
        if h.kv_head_count > 0 and h.head_dim > 0:
            shape = (n // (h.kv_head_count * h.head_dim), h.kv_head_count, h.head_dim)
        elif n == 0:
            shape = (0, max(h.kv_head_count, 1), max(h.head_dim, 1))
    elif len(shape) != 3 or math.prod(shape) != n:
        raise UnsupportedConfigError(f"shape {tuple(shape)} does not hold the blob's {n} elements as (T, H, D)")

    # An empty chunk has no K bytes yet has a K; a V-only blob has V bytes and no K.
    has_k = bool(k_len) or not v_len
    if dev.type == "cpu":
        # V that is dequantized, or copied into out_v, is only read.
        v_transient = not raw_v or out_v is not None
        k_src, v_src = payload[:k_len], payload[k_len : k_len + v_len]
        n_out = k_len if v_transient else k_len + v_len
        if _k_copy is not None and v_transient:
            k_src = _k_copy
        elif (payload.readonly or copy) and n_out:
            # What must be copied (K, and raw V for the caller) goes into one fresh
            # buffer in one memcpy; the tensors are views of it.
            own = memoryview(native.empty_bytearray(n_out))
            own[:] = payload[:n_out]
            k_src = own[:k_len]
            if not v_transient:
                v_src = own[k_len:]
        k_t = _view(k_src, h.k_dtype, False) if has_k else None
        v_t = _view(v_src, h.v_dtype, False, transient=v_transient)
    else:
        # One host-to-device transfer of K and V; scales travel on their own
        # (their offset may be unaligned).
        dev_raw = _view(payload[: k_len + v_len], torch.uint8, False, transient=True).to(dev)
        k_t = dev_raw[:k_len].view(h.k_dtype) if has_k else None
        v_t = dev_raw[k_len:].view(h.v_dtype)

    unit = h.scale_scope == ScaleScope.NONE or h.scale_scheme == ScaleScheme.UNIT
    s_t: torch.Tensor | None = None
    if unit:
        s_t = torch.ones((), dtype=torch.float32, device=dev)
    elif h.scale_payload_len:
        s_mv = payload[k_len + v_len : k_len + v_len + h.scale_payload_len]
        s_t = _view(s_mv, h.scale_dtype, True).reshape(h.scale_shape).to(dev)
        if scales is not None:
            given = _as_scales(scales, dev, h.scale_dtype)
            if given.numel() != s_t.numel() or not torch.equal(given.reshape(s_t.shape), s_t):
                raise UnsupportedConfigError("scales= given, but the blob stores its own, different scales")
    elif h.scale_scope in _COMPUTED and math.prod(h.scale_shape) == 0:
        s_t = torch.empty(h.scale_shape, dtype=h.scale_dtype, device=dev)
    elif h.scale_scope == ScaleScope.EXTERNAL and scales is not None:
        # Quantized with the scales cast to the blob's scale dtype: use them so.
        s_t = _as_scales(scales, dev, h.scale_dtype)

    if shape is not None:
        if k_t is not None:
            k_t = k_t.view(shape)
        v_t = v_t.view(shape)
    if out_k is not None:
        if k_t is None:
            raise UnsupportedConfigError("out_k given but the blob holds no K")
        _into(out_k, k_t, "out_k")
        k_t = out_k

    if raw_v:
        if out_v is not None:
            _into(out_v, v_t, "out_v")
            v_t = out_v
        return DecodedKV(k_t, v_t, s_t, h)

    if s_t is None:
        raise UnsupportedConfigError("cannot dequantize an external-scope blob without its scales: pass scales=")
    if unit:
        scope = ScaleScope.PER_TENSOR
    elif h.scale_scope == ScaleScope.EXTERNAL:
        scope = _external_scope(s_t, shape[1] if shape is not None else 1)
    else:
        scope = h.scale_scope
    dq_shape = shape
    if dq_shape is None:
        if scope != ScaleScope.PER_TENSOR:
            raise UnsupportedConfigError(
                f"the blob leaves kv_head_count/head_dim unset and its {h.scale_scope.name} scales need "
                "them: pass shape=(tokens, heads, head_dim)"
            )
        dq_shape = (1, 1, n)  # one scale for all: any grouping of the elements will do
    ps = h.page_size if h.page_size > 0 else None
    impl = _impl(resolve_backend(backend, dev))
    v3 = v_t.reshape(dq_shape)
    target = None
    if out_v is not None:
        if out_v.numel() != n:
            raise UnsupportedConfigError(f"out_v has shape {tuple(out_v.shape)}; the blob's V has {n} elements")
        try:
            target = out_v if tuple(out_v.shape) == dq_shape else out_v.view(dq_shape)
        except RuntimeError:
            target = None  # strides that cannot take that shape: go through a temporary
    v_dq = impl.dequantize(v3, s_t, scope, page_size=ps, out_dtype=out_v_dtype, out=target)
    if out_v is not None:
        if target is None:
            out_v.copy_(v_dq.reshape(out_v.shape))
        return DecodedKV(k_t, out_v, s_t, h)
    return DecodedKV(k_t, v_dq if shape is not None else v_dq.reshape(-1), s_t, h)

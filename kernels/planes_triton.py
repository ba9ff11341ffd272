"""K's byte planes for the lossless payload on the device: split a 16-bit K into them and merge it back.

The lossless payload (``docs/FORMAT.md``, "Lossless payload") stores a 16-bit K as two byte planes:
the high bytes (sign and exponent) laid out channel by channel per head, ``hi[h, d, t]``, which the
host's Huffman stage codes, and the low bytes (mantissa bits) raw and token-major, ``lo[t, h, d]``.
On the host the C loops (``kvcodec/csrc/planes.c``) do the split and merge; these kernels do the same
bytes on the GPU, so a K that lives there crosses to the host as its two planes (encode) and comes
back as them (decode), with no host transpose:

* ``_planes_split_kernel``: ``[T, H, D]`` 16-bit K (any strides) -> ``hi`` ``[H, D, T]`` and ``lo``
  ``[T, H, D]``, both uint8 and contiguous;
* ``_planes_merge_kernel``: the reverse, into a 16-bit ``[T, H, D]`` output of any strides.

One program per (token tile, head). The bytes are those of a little-endian 16-bit element (byte 0 the
low plane's, byte 1 the high plane's), moved as integers: fp16 and bf16 alike, NaN and Inf included.
Argument names follow :mod:`kvcodec.kernels.device` (``k`` K in, ``ko`` K out); ``hi``/``lo`` are the
planes (contiguous: no strides). Offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import Reason, UnsupportedConfigError
from .launch import launch
from .operands import PLANE_DTYPES, check_device, check_tensor3
from .tiles import pick_config, register_plain

__all__ = ["merge_k_planes", "split_k_planes"]


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit
def _tile(T, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's (token tile, head): token, head and channel indices and the tile's mask."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    return t, h, d, (t[:, None] < T) & (d[None, :] < D)


@triton.jit
def _planes_split_kernel(
    k_ptr,
    hi_ptr,
    lo_ptr,
    T,
    H,
    D,
    k_st,
    k_sh,
    k_sd,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (token tile, head) of K's int16 bits into its bytes: high to ``hi[h, d, t]``, low to ``lo[t, h, d]``."""
    t, h, d, m = _tile(T, D, BLOCK_T, BLOCK_D)
    x = tl.load(k_ptr + t[:, None] * k_st + h * k_sh + d[None, :] * k_sd, mask=m, other=0)
    tl.store(lo_ptr + (t[:, None] * H + h) * D + d[None, :], x.to(tl.uint8), mask=m)
    tl.store(hi_ptr + (h * D + d[None, :]) * T + t[:, None], (x >> 8).to(tl.uint8), mask=m)


@triton.jit
def _planes_merge_kernel(
    hi_ptr,
    lo_ptr,
    ko_ptr,
    T,
    H,
    D,
    ko_st,
    ko_sh,
    ko_sd,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (token tile, head) of K's int16 bits from ``hi[h, d, t]`` (high byte) and ``lo[t, h, d]`` (low)."""
    t, h, d, m = _tile(T, D, BLOCK_T, BLOCK_D)
    hi = tl.load(hi_ptr + (h * D + d[None, :]) * T + t[:, None], mask=m, other=0)
    lo = tl.load(lo_ptr + (t[:, None] * H + h) * D + d[None, :], mask=m, other=0)
    x = (hi.to(tl.int32) << 8) | lo.to(tl.int32)
    tl.store(ko_ptr + t[:, None] * ko_st + h * ko_sh + d[None, :] * ko_sd, x.to(tl.int16), mask=m)


register_plain("_planes_split_kernel", _planes_split_kernel)
register_plain("_planes_merge_kernel", _planes_merge_kernel)


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


def _check_k(name: str, k: torch.Tensor) -> None:
    """``k`` is a ``[T, H, D]`` fp16 or bf16 tensor."""
    check_tensor3(name, k, PLANE_DTYPES)


def _plane(name: str, p: torch.Tensor | None, n: int, dev: torch.device) -> torch.Tensor:
    """Plane ``p`` checked (contiguous uint8 of ``n`` bytes on ``dev``), or a new one when None."""
    if p is None:
        return torch.empty(n, dtype=torch.uint8, device=dev)
    if p.dtype != torch.uint8 or p.numel() != n or not p.is_contiguous():
        raise UnsupportedConfigError(
            f"{name} must be a contiguous uint8 tensor of {n} bytes; got {p.dtype} {tuple(p.shape)}"
            f"{'' if p.is_contiguous() else ' (not contiguous)'}",
            reason=Reason.BAD_OUTPUT,
        )
    if p.device != dev:
        raise UnsupportedConfigError(f"{name} is on {p.device}; K is on {dev}", reason=Reason.BAD_DEVICE)
    return p


def _launch(name: str, kernel: object, kw: dict[str, object], tokens: int, heads: int, dim: int) -> None:
    """Launch a planes kernel over (token tiles, heads) with :func:`~kvcodec.kernels.tiles.pick_config`'s tile."""
    block_d = triton.next_power_of_2(dim)
    dev = next(v.device for v in kw.values() if isinstance(v, torch.Tensor))
    kw.update(T=tokens, H=heads, D=dim)
    cfg = pick_config(name, kw, tokens, block_d, dev)
    kw.update(BLOCK_T=cfg.block_t, BLOCK_D=block_d, num_warps=cfg.num_warps)
    launch(kernel, (triton.cdiv(tokens, cfg.block_t), heads), kw)


def split_k_planes(
    k: torch.Tensor, *, hi: torch.Tensor | None = None, lo: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """K's high plane (``[H, D, T]``) and low plane (``[T, H, D]``), each flat uint8 of ``T*H*D`` bytes.

    ``k``: ``[T, H, D]`` fp16 or bf16, any strides. ``hi``/``lo``: contiguous uint8 outputs of that
    many bytes (any shape), else new ones. The bytes equal :func:`kvcodec.backends.k_planes`'s split.
    """
    _check_k("k", k)
    dev = check_device(k)
    tokens, heads, dim = k.shape
    n = tokens * heads * dim
    hi, lo = _plane("hi", hi, n, dev), _plane("lo", lo, n, dev)
    if n:
        kw: dict[str, object] = {"k_ptr": k.view(torch.int16), "hi_ptr": hi, "lo_ptr": lo}
        kw.update(k_st=k.stride(0), k_sh=k.stride(1), k_sd=k.stride(2))
        _launch("_planes_split_kernel", _planes_split_kernel, kw, tokens, heads, dim)
    return hi, lo


def merge_k_planes(hi: torch.Tensor, lo: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (``[T, H, D]`` fp16 or bf16, any strides) written from K's planes; returns ``out``.

    ``hi``: the high plane ``[H, D, T]``, ``lo``: the low plane ``[T, H, D]``, each a contiguous uint8
    tensor of ``T*H*D`` bytes (any shape). The reverse of :func:`split_k_planes`, bit for bit.
    """
    _check_k("out", out)
    dev = check_device(out, hi, lo)
    tokens, heads, dim = out.shape
    n = tokens * heads * dim
    _plane("hi", hi, n, dev)
    _plane("lo", lo, n, dev)
    if n:
        kw: dict[str, object] = {"hi_ptr": hi, "lo_ptr": lo, "ko_ptr": out.view(torch.int16)}
        kw.update(ko_st=out.stride(0), ko_sh=out.stride(1), ko_sd=out.stride(2))
        _launch("_planes_merge_kernel", _planes_merge_kernel, kw, tokens, heads, dim)
    return out

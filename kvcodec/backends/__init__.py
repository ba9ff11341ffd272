"""Backends: three implementations of one interface, chosen and fallen back from here only.

* ``torch`` (:mod:`.reference`): torch ops, any device; the reference, never declines.
* ``cpu`` (:mod:`.cpu`): vectorised C loops for CPU tensors (``kvcodec._cpu``, built at install).
* ``triton`` (:mod:`.triton`): Triton kernels on CUDA (or CPU under ``TRITON_INTERPRET=1``).

``auto`` takes Triton on CUDA when installed, the C loops on CPU when built,
the reference otherwise. A backend that cannot serve one call raises
:class:`~.base.Declined`; :func:`call` then runs the reference (or, for an optional
lane, the caller's ``fallback``) and counts the reason, which :func:`backend_info`
reports. Nothing outside this package catches :class:`~.base.Declined`.

The cache lanes (:func:`scatter_rows`, :func:`scatter_blob_rows_many`) and
:func:`cache_lanes_available` are how the integrations reach the C loops: no module
outside this package imports :mod:`.cpu` (an import contract in ``pyproject.toml``).
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..env import triton_interpret
from ..errors import Reason, UnsupportedConfigError
from . import reference
from .base import LANES, Backend, BlobRows, Declined, Groups, Served

__all__ = [
    "BACKEND_NAMES",
    "LANES",
    "Backend",
    "BlobRows",
    "Declined",
    "Groups",
    "Served",
    "backend_info",
    "cache_lanes_available",
    "call",
    "huff_decode_many",
    "huff_encode_many",
    "huff_encode_pairs_many",
    "k_planes",
    "lossless_expand",
    "note_declined",
    "reference_backend",
    "scatter_blob_rows_many",
    "scatter_rows",
    "select",
    "v_nibbles",
    "v_nibbles_pairs",
]

BACKEND_NAMES = ("auto", "torch", "cpu", "triton")
_ALIASES = {"native": "cpu", "reference": "torch"}

_fallbacks: Counter[tuple[str, str, str]] = Counter()
_lock = threading.Lock()


_cpu_module: Any = None


def _cpu() -> Any:
    """The C-loops module (imported on first use: it loads the extension; kept after that, since the
    lossless stage asks for it several times a blob and an import statement costs a microsecond)."""
    global _cpu_module
    if _cpu_module is None:
        from . import cpu

        _cpu_module = cpu
    return _cpu_module


def reference_backend() -> Backend:
    """The torch backend every other is tested against."""
    return reference.BACKEND


def _triton_reason(device: torch.device) -> str | None:
    """Why Triton cannot run on ``device`` (None when it can)."""
    if device.type == "cpu":
        return None if triton_interpret() else "CPU tensors need TRITON_INTERPRET=1"
    if device.type != "cuda":
        return f"no Triton backend for {device.type}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def _reason(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run on ``device`` (None when it can)."""
    if name == "torch":
        return None
    if name == "cpu":
        if device.type != "cpu":
            return f"the C loops read CPU tensors only, not {device.type}"
        return None if _cpu().AVAILABLE else _cpu().REASON
    return _triton_reason(device)


def _resolve_name(backend: str | None, device: torch.device) -> str:
    b = backend or os.environ.get("KVCODEC_BACKEND") or "auto"
    if not isinstance(b, str):
        raise UnsupportedConfigError(
            f"backend must be a name; got {type(b).__name__} {b!r}", reason=Reason.BAD_TYPE
        )
    b = b.lower()
    b = _ALIASES.get(b, b)
    if b not in BACKEND_NAMES:
        raise UnsupportedConfigError(
            f"unknown backend {b!r}; expected one of {BACKEND_NAMES}", reason=Reason.BAD_VALUE
        )
    if b == "auto":
        if device.type == "cuda":
            return "triton" if _triton_reason(device) is None else "torch"
        return "cpu" if device.type == "cpu" and _cpu().AVAILABLE else "torch"
    why = _reason(b, device)
    if why is not None:
        raise UnsupportedConfigError(
            f"backend {b!r} cannot run on {device}: {why}", reason=Reason.BACKEND_UNAVAILABLE
        )
    return b


def _device(device: torch.device | str) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise UnsupportedConfigError(f"bad device {device!r}: {e}", reason=Reason.BAD_DEVICE) from None


_CPU = torch.device("cpu")
_on_cpu: dict[tuple[str | None, bool], Backend] = {}
"""What :func:`select` gave for a name (as passed, or ``KVCODEC_BACKEND``'s) on the CPU, by whether
the C loops are available: a name that resolves without any other switch (not Triton, which reads
``TRITON_INTERPRET``) gives the same backend every time, so a decode need not resolve it again."""


def select(backend: str | None, device: torch.device | str) -> Backend:
    """The backend for ``device``: ``None`` reads ``KVCODEC_BACKEND`` (default ``"auto"``).

    An explicit backend that cannot run on ``device`` raises :class:`UnsupportedConfigError`.
    """
    if type(device) is torch.device and device == _CPU:
        name = backend if backend else os.environ.get("KVCODEC_BACKEND")
        if name is None or type(name) is str:
            return _select_cpu(name)
    return _select(backend, _device(device))


def _select_cpu(name: str | None) -> Backend:
    """:func:`select` on the CPU for a name (None: ``auto``) already read from the environment."""
    key = (name, _cpu().AVAILABLE)
    got = _on_cpu.get(key)
    if got is None:
        got = _select(name, _CPU)
        if got.name != "triton":
            if len(_on_cpu) >= 64:  # names differing only in case: keep it small
                _on_cpu.clear()
            _on_cpu[key] = got
    return got


def _select(backend: str | None, dev: torch.device) -> Backend:
    """:func:`select` for a parsed device."""
    name = _resolve_name(backend, dev)
    if name == "cpu":
        return _cpu().BACKEND
    if name == "triton":
        from . import triton as triton_backend

        return triton_backend.BACKEND
    return reference.BACKEND


def _count(backend: Backend, op: str, why: Declined) -> None:
    with _lock:
        _fallbacks[(backend.name, op, str(why))] += 1


def note_declined(backend: Backend, op: str, why: str) -> None:
    """Count a decline that a lane's caller met outside :func:`call` (the dequantization a lossless
    expansion carried, declined in C), so :func:`backend_info` shows it as any other."""
    _count(backend, op, Declined(why))


def call(
    backend: Backend, op: str, *args: Any, fallback: Callable[[], Any] | None = None, **kwargs: Any
) -> Any:
    """``backend.op(*args, **kwargs)``; when the backend declines (counted), ``fallback()`` when given (an
    optional lane's caller's own path), else the reference's ``op`` on the same arguments."""
    try:
        return getattr(backend, op)(*args, **kwargs)
    except Declined as e:
        _count(backend, op, e)
        if fallback is not None:
            return fallback()
        return getattr(reference.BACKEND, op)(*args, **kwargs)


def cache_lanes_available() -> bool:
    """Whether the cache lanes (the C loops) are built: what :func:`scatter_blob_rows_many` needs to
    serve, so a caller can keep a blob's rows for it rather than decode them first."""
    return bool(_cpu().AVAILABLE)


def k_planes(k: Any, hi: Any, lo: Any, tokens: int, heads: int, dim: int, *, merge: bool) -> bool:
    """K's byte planes for the lossless payload, split (``merge=False``) or merged by the C loops
    (:func:`kvcodec.backends.cpu.k_planes`); False when they are not built: the caller's numpy then."""
    return bool(_cpu().k_planes(k, hi, lo, tokens, heads, dim, merge))


def v_nibbles(v: Any, exp: Any, nib: Any, tokens: int, heads: int, dim: int, *, merge: bool) -> bool:
    """V's codes for the split lossless payload, split (``merge=False``) into exponents and sign +
    mantissa nibbles or merged by the C loops (:func:`kvcodec.backends.cpu.v_nibbles`); False when they
    are not built: the caller's numpy then."""
    return bool(_cpu().v_nibbles(v, exp, nib, tokens, heads, dim, merge))


def v_nibbles_pairs(v: Any, exp2: Any, nib: Any, tokens: int, heads: int, dim: int) -> bool:
    """:func:`v_nibbles`' split with each head's exponents two a byte, for :func:`huff_encode_pairs_many`
    (:func:`kvcodec.backends.cpu.v_nibbles_pairs`); False when the C loops are not built."""
    return bool(_cpu().v_nibbles_pairs(v, exp2, nib, tokens, heads, dim))


def huff_encode_pairs_many(
    src: Any, at: int, step: int, count: int, n: int, out: Any, out_at: int
) -> list[int] | None:
    """Streams of ``n`` symbols below 16 given two a byte, coded by the C loops
    (:func:`kvcodec.backends.cpu.huff_encode_pairs_many`): their lengths; None when they are not built."""
    return _cpu().huff_encode_pairs_many(src, at, step, count, n, out, out_at)


def huff_encode_many(
    src: Any, at: int, step: int, count: int, n: int, row: int, stride: int, out: Any, out_at: int
) -> list[int] | None:
    """A lossless section's Huffman streams coded by the C loops, one after another
    (:func:`kvcodec.backends.cpu.huff_encode_many`): their lengths; None when they are not built: the
    caller's Python coder then."""
    return _cpu().huff_encode_many(src, at, step, count, n, row, stride, out, out_at)


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
    """A split lossless payload expanded by the C loops in one call
    (:func:`kvcodec.backends.cpu.lossless_expand`): True, ``("crc", got)``, or ``("V" | "K", i, code)``;
    with ``deq`` its codes dequantized too, or why C declined that (a str); False when they are not
    built: the caller's stage by stage path then."""
    return _cpu().lossless_expand(
        payload, k_len, v_len, k_streams, k_raw_at, v_streams, v_raw_at, shape, k_out, v_out, plane, crc, deq
    )


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
    """A lossless section's Huffman streams decoded by the C loops
    (:func:`kvcodec.backends.cpu.huff_decode_many`): True, or ``(i, code)`` for the first refused; None
    when they are not built: the caller's Python coder then."""
    return _cpu().huff_decode_many(src, streams, n, out, out_at, out_step, row, stride)


def scatter_rows(
    src: torch.Tensor, cache: torch.Tensor, col: int, runs: np.ndarray, *, fallback: Callable[[], None]
) -> None:
    """``src`` ``[T, H, D]`` rows into columns ``col .. col + D`` of a ``[N, H, S, C]`` cache view by
    ``runs`` (the cpu backend's lane), or ``fallback()`` when it declines (a layout C does not take;
    nothing written then). A run outside the view or ``src`` raises."""
    call(_cpu().BACKEND, "scatter_rows", src, cache, col, runs, fallback=fallback)


def scatter_blob_rows_many(
    writes: Sequence[tuple[BlobRows, torch.Tensor, int | None]], v_col: int, runs: np.ndarray
) -> list[Served | None]:
    """Each ``(rows, cache, crc)`` of a chunk's layers (one ``v_col``, the same ``runs``) written by the
    cpu backend's lane in one call: per layer its :class:`Served` (``crc``: the seed continued over the
    blob's K and codes, None when not folded in), or None where it declined (counted; nothing written
    there: the caller writes that layer its own way)."""
    be = _cpu().BACKEND
    out: list[Served | None] = []
    for got in be.scatter_blob_rows_many(writes, v_col, runs):
        if isinstance(got, Declined):
            _count(be, "scatter_blob_rows_many", got)
            got = None
        out.append(got)
    return out


def backend_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What ``auto`` picks on ``device``, which backends could run there and why not, and fallbacks so far."""
    dev = _device(device)
    reasons = {n: _reason(n, dev) for n in BACKEND_NAMES[1:]}
    with _lock:
        falls = [{"backend": b, "op": o, "reason": r, "count": c} for (b, o, r), c in _fallbacks.items()]
    return {
        "device": str(dev),
        "auto": _resolve_name("auto", dev),
        "env": os.environ.get("KVCODEC_BACKEND"),
        "available": {n: r is None for n, r in reasons.items()},
        "unavailable_reasons": {n: r for n, r in reasons.items() if r is not None},
        "fallbacks": falls,
    }

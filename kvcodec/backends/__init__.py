"""Backends: three implementations of one interface, chosen and fallen back from here only.

* ``torch`` (:mod:`.reference`): torch ops, any device; the reference, never declines.
* ``cpu`` (:mod:`.cpu`): vectorised C loops for CPU tensors (``kvcodec._cpu``, built at install).
* ``triton`` (:mod:`.triton`): Triton kernels on CUDA (or CPU under ``TRITON_INTERPRET=1``).

``auto`` takes Triton on CUDA when installed, the C loops on CPU when built,
the reference otherwise. A backend that cannot serve one call raises
:class:`~.base.Declined`; :func:`call` then runs the reference and counts the
reason, which :func:`backend_info` reports.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from typing import Any

import torch

from ..env import triton_interpret
from ..errors import Reason, UnsupportedConfigError
from . import reference
from .base import Backend, Declined, Groups

__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "Declined",
    "Groups",
    "backend_info",
    "call",
    "reference_backend",
    "select",
]

BACKEND_NAMES = ("auto", "torch", "cpu", "triton")
_ALIASES = {"native": "cpu", "reference": "torch"}

_fallbacks: Counter[tuple[str, str, str]] = Counter()
_lock = threading.Lock()


def _cpu() -> Any:
    """The C-loops module (imported on first use: it loads the extension)."""
    from . import cpu

    return cpu


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


def call(backend: Backend, op: str, *args: Any, **kwargs: Any) -> Any:
    """``backend.op(*args, **kwargs)``, or the reference's when the backend declines (counted)."""
    try:
        return getattr(backend, op)(*args, **kwargs)
    except Declined as e:
        with _lock:
            _fallbacks[(backend.name, op, str(e))] += 1
        return getattr(reference.BACKEND, op)(*args, **kwargs)


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

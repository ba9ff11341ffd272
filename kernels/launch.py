"""Where kvcodec's kernels launch: the target a launch is planned for, and a launch recorder.

Launch decisions (tile sizes, one pass or two, hardware FP8 converts) depend on
the target: Triton's CPU interpreter, or a CUDA GPU with some SM count and
compute capability. :func:`recording` plans launches for a simulated CUDA
target on CPU tensors and records them instead of running them, so that
the kernel audit (``dev/kernel_audit.py``) can compile exactly those launches
ahead of time on a machine without a GPU.

Every CUDA launch passes ``enable_fp_fusion=False``: no kernel relies on
contraction (bit-exactness forbids it), and Triton 3.10 flips the default.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..env import triton_interpret

__all__ = [
    "H200",
    "INTERPRET",
    "INTERPRETER",
    "Launch",
    "Target",
    "current_target",
    "is_recording",
    "launch",
    "recording",
]

INTERPRET: bool = triton_interpret()
"""True when the kernels were built for Triton's CPU interpreter (``TRITON_INTERPRET`` at import)."""


@dataclass(frozen=True)
class Target:
    """What launch planning depends on."""

    interpret: bool
    sm_count: int
    capability: tuple[int, int]
    name: str = ""

    @property
    def hw_fp8(self) -> bool:
        """True where the GPU converts fp32 <-> FP8 in hardware (sm_89 and later)."""
        return not self.interpret and self.capability >= (8, 9) and _hw_fp8_allowed()

    @property
    def hw_bf16(self) -> bool:
        """True where fp32 -> bf16 is one hardware round-to-nearest-even convert (sm_80 and later)."""
        return not self.interpret and self.capability >= (8, 0)


H200 = Target(False, 132, (9, 0), "NVIDIA H200 (simulated)")
"""The headline target of the kernel audit."""

INTERPRETER = Target(True, 1, (0, 0), "triton-interpreter")


def _hw_fp8_allowed() -> bool:
    return os.environ.get("KVCODEC_HW_FP8", "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass
class Launch:
    """One recorded launch: the kernel object as launched (autotuner, heuristics or JIT), grid, kwargs."""

    kernel: Any
    grid: Any
    kwargs: dict[str, Any]
    target: Target


@dataclass
class _Recorder:
    target: Target
    launches: list[Launch] = field(default_factory=list)


_REC: _Recorder | None = None
_TARGETS: dict[int, Target] = {}


def is_recording() -> bool:
    """True inside :func:`recording` (launchers then accept CPU tensors and launch nothing)."""
    return _REC is not None


@contextlib.contextmanager
def recording(target: Target = H200) -> Iterator[list[Launch]]:
    """Plan launches for ``target`` on CPU tensors and record them instead of running them.

    Yields the list the launches are appended to. Outputs are left unwritten.
    """
    global _REC
    prev = _REC
    _REC = _Recorder(target)
    try:
        yield _REC.launches
    finally:
        _REC = prev


def current_target(dev: torch.device) -> Target:
    """The target launches on ``dev`` are planned for (the simulated one while recording)."""
    if _REC is not None:
        return _REC.target
    if INTERPRET or dev.type != "cuda":
        return INTERPRETER
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    t = _TARGETS.get(idx)
    if t is None:
        p = torch.cuda.get_device_properties(idx)
        t = _TARGETS[idx] = Target(False, p.multi_processor_count, (p.major, p.minor), p.name)
    return t


def launch(kernel: Any, grid: Any, kw: dict[str, Any]) -> None:
    """Launch ``kernel[grid](**kw)``, or record it inside :func:`recording`."""
    if _REC is not None:
        _REC.launches.append(Launch(kernel, grid, dict(kw), _REC.target))
        return
    if INTERPRET:
        import numpy as np

        with np.errstate(all="ignore"):  # NaN/Inf arithmetic is intended
            kernel[grid](**kw)
    else:
        kernel[grid](enable_fp_fusion=False, **kw)

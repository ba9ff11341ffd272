"""Triton kernels of kvcodec, installed as ``kvcodec.kernels``.

Importing this package does not import Triton; each kernel module does, and
is only loaded when the Triton backend is asked for:

* :mod:`kvcodec.kernels.quant_triton`: scales, FP8 quantize/dequantize and
  the fused chunk encode/decode (one or all layers per launch), bit-exact
  with the torch backend (:mod:`kvcodec.backends.reference`).
* :mod:`kvcodec.kernels.paged_triton`: vLLM paged-cache gather/scatter and
  the fused paged encode/decode, bit-exact with :mod:`kvcodec.paged`.
* :mod:`kvcodec.kernels.vllm_triton`: fused gather+encode and decode+scatter
  over vLLM 0.33's per-layer views (any ``KVCacheLayout``, all layers of a
  chunk in one launch), and ``ChunkEncoder`` (one launch, asynchronous copy
  into a caller's pinned buffer, headers from one ``HeaderPacker``).
* ``_launch`` (launch targets, the recorder the kernel audit uses),
  ``_configs`` (config space, heuristic, tuning file), ``_tl`` (device helpers).

Kernels run on CUDA tensors, or on CPU tensors in Triton's interpreter when
``TRITON_INTERPRET=1`` is set before they are first imported.
"""

from __future__ import annotations

import importlib.util
import types
from typing import Any

__all__ = ["reference", "triton_installed"]


def triton_installed() -> bool:
    """True when Triton can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def reference() -> Any:
    """The torch reference the kernels equal bit for bit (``compute_scales``, ``quantize``, ``fp8_max``...).

    One place that knows where the core package keeps it, for the kernel
    tests, ``bench/gpu_check.py`` and ``kvcodec tune``.
    """
    from .. import numerics
    from ..backends import reference as ref

    return types.SimpleNamespace(**{**vars(numerics), **vars(ref)})

"""Triton kernels of kvcodec, installed as ``kvcodec.kernels``: tensors in, tensors out.

The kernels know tensors only (never blobs or headers: the codec builds
those around them). Importing this package does not import Triton; the
kernel modules do, and are loaded only when the Triton backend (or the vLLM
connector's fused path) asks for them:

* :mod:`.quant_triton`: the quantize kernels (group absmax, FP8 codes)
  and their unfused launchers, bit-exact with the torch reference
  (:mod:`kvcodec.backends.reference`);
* :mod:`.dequant_triton`: the dequantize kernel (also the fused decode)
  and its unfused launcher;
* :mod:`.fused_triton`: the fused encode/decode of a chunk's payload
  ``K ‖ FP8(V) ‖ scales``, one or all layers per launch;
* :mod:`.vllm_triton`: the fused gather+encode and decode+scatter over
  vLLM 0.33's per-layer cache views (any ``KVCacheLayout``);
* :mod:`.planes_triton`: K's byte planes of the lossless payload (high
  plane channel by channel, low plane token-major), split and merged;
* :mod:`.operands` (argument checks, payload geometry, operand and layer
  addressing), :mod:`.device` (Triton device helpers, the argument naming
  scheme), :mod:`.tiles` (the tile-kernel registry and launch path),
  :mod:`.configs` (config space, heuristic, tuning file: the config choice),
  :mod:`.launch` (launch targets and the recorder the kernel audit uses).

Kernels run on CUDA tensors, or on CPU tensors in Triton's interpreter when
``TRITON_INTERPRET`` is on (:func:`kvcodec.env.triton_interpret`) before
they are first imported.
"""

from __future__ import annotations

import importlib.util

__all__ = ["triton_installed"]


def triton_installed() -> bool:
    """True when Triton can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None

"""The Triton preamble of every kernel test, in one place.

Without a GPU the kernels run on CPU tensors in Triton's interpreter, which
must be switched on (``TRITON_INTERPRET``) before Triton and the kernels are
first imported: this conftest sets it before any test module of the folder
is imported (``tests/conftest.py`` does too, for tests elsewhere). Autotuning
is off, as in a serving process. A test module calls :func:`require_kernels`
before importing the kernels and sets ``pytestmark = KERNEL_MARKS``.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

CUDA = torch.cuda.is_available()
"""Kernel tests run on CUDA when there is a GPU, else in the interpreter."""
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("KVCODEC_AUTOTUNE", "0")

DEVICE = "cuda" if CUDA else "cpu"
KERNEL_MARKS = [pytest.mark.cuda if CUDA else pytest.mark.interpreter]
"""``pytestmark`` of a kernel test module: selected by ``-m cuda`` on a GPU, ``-m interpreter`` without."""


def require_kernels() -> None:
    """Skip the calling module without Triton, or when the kernels were imported outside the interpreter on CPU."""
    pytest.importorskip("triton", reason="triton not installed")
    from kvcodec.kernels.launch import INTERPRET

    if not CUDA and not INTERPRET:
        pytest.skip(
            "kvcodec.kernels was imported before TRITON_INTERPRET was set and there is no GPU",
            allow_module_level=True,
        )


def reference_ops() -> types.SimpleNamespace:
    """The torch reference the kernels equal bit for bit: :mod:`kvcodec.numerics` and the torch backend's ops."""
    from kvcodec import numerics
    from kvcodec.backends import reference

    return types.SimpleNamespace(**{**vars(numerics), **vars(reference)})

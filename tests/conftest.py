"""Shared test preamble and fixtures: the Triton interpreter switch, the LMCKV test vectors.

``tests/vectors`` (made by LMCache 0.5.6, committed) is always there; ``../shared/vectors``
is an extra set, and only the tests over it skip when a clone lacks it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests._helpers import read_vector
from tests.paths import SHARED_VECTORS, VECTORS

# Triton decides at import time whether kernels run in its CPU interpreter, so
# without a GPU the switch must be set before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def vectors_dir() -> Path:
    """The committed vector folder (tests/vectors); its absence is a failure, never a skip."""
    if not (VECTORS / "manifest.json").is_file():
        pytest.fail(f"{VECTORS}/manifest.json is missing: rerun dev/make_vectors.py")
    return VECTORS


@pytest.fixture(scope="session")
def shared_vectors_dir() -> Path:
    """The reference's vector folder beside the clone; skips the test when absent."""
    if not (SHARED_VECTORS / "manifest.json").is_file():
        pytest.skip(f"no shared vectors at {SHARED_VECTORS} (an extra check beside tests/vectors)")
    return SHARED_VECTORS


@pytest.fixture(scope="session")
def vector(vectors_dir: Path) -> Callable[[str], bytes]:
    """``vector(name)``: the bytes of ``name`` in tests/vectors."""
    return lambda name: read_vector(vectors_dir, name)

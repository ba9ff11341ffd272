"""Shared fixtures: the LMCKV test vectors in ../shared/vectors (never copied into the repo)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.paths import SHARED_VECTORS

# Triton decides at import time whether kernels run in its CPU interpreter, so
# without a GPU the switch must be set before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

VECTORS_DIR = SHARED_VECTORS


@pytest.fixture(scope="session")
def vectors_dir() -> Path:
    """The test-vector folder; skips the test when it is absent."""
    if not (VECTORS_DIR / "manifest.json").is_file():
        pytest.skip(f"LMCKV test vectors not found at {VECTORS_DIR} (expected ../shared/vectors)")
    return VECTORS_DIR


@pytest.fixture(scope="session")
def vector(vectors_dir: Path) -> Callable[[str], bytes]:
    """``vector(name)``: the bytes of ``NAME`` (a full file name, or a vector name + ``.blob``)."""

    def load(name: str) -> bytes:
        path = vectors_dir / name
        if not path.suffix:
            path = path.with_suffix(".blob")
        return path.read_bytes()

    return load

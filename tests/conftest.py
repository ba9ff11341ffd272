"""Shared test preamble and fixtures: the Triton interpreter switch, the LMCKV test vectors.

``tests/vectors`` (made by LMCache 0.5.6, committed) is always there; ``../shared/vectors``
is an extra set, and only the tests over it skip when a clone lacks it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests._helpers import read_vector
from tests.paths import REPO_ROOT, SHARED_VECTORS, VECTORS, repo_root_entries


def _keep_the_repo_root_off_sys_path() -> None:
    """The repo root is never an import path here: its top-level ``kernels/`` (installed as
    ``kvcodec.kernels``) would shadow the installed ``kernels`` that transformers imports.

    pytest runs with ``--import-mode=importlib`` (the ``tests`` package is imported by location)
    and ``make test`` starts it without the working directory on ``sys.path``; ``python -m pytest``
    from the root puts the root there, so it is taken off before any test module imports anything.
    Child interpreters inherit ``PYTHONSAFEPATH``: neither their working directory nor their
    script's folder goes first on their ``sys.path`` (``tests.paths.IMPORT_TESTS`` for the helpers).
    """
    if not (REPO_ROOT / "kernels").is_dir():
        return  # a copy of the tests beside a built package (make test-asan / test-portable): no checkout
    for entry in repo_root_entries(sys.path):
        sys.path.remove(entry)
    shadow = sys.modules.get("kernels")
    if shadow is not None and repo_root_entries([str(Path(shadow.__file__ or ".").parents[1])]):
        raise RuntimeError(
            f"the repo's kernels/ was imported as `kernels` ({shadow.__file__}) before the tests"
        )
    os.environ["PYTHONSAFEPATH"] = "1"


_keep_the_repo_root_off_sys_path()

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

"""Where the tests find the repository and the test vectors."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The repository's root (the folder holding ``pyproject.toml``)."""

VECTORS = REPO_ROOT / "tests" / "vectors"
"""Vectors made by LMCache 0.5.6 (``dev/make_vectors.py``), committed: every clone has them."""

SHARED_VECTORS = REPO_ROOT.parent / "shared" / "vectors"
"""Vectors made by the reference implementation, beside the clone when present (an extra check)."""

TESTS = REPO_ROOT / "tests"
"""This test package."""


def import_tests_package() -> None:
    """Make this ``tests`` package importable by its location, without the repo root on ``sys.path``.

    The root's ``kernels/`` would shadow the installed ``kernels`` that transformers imports, so a
    child process or a bench script that needs the test helpers runs this file by its path
    (:data:`IMPORT_TESTS`) instead of putting the root on its path.
    """
    if "tests" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        "tests", TESTS / "__init__.py", submodule_search_locations=[str(TESTS)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["tests"] = module
    spec.loader.exec_module(module)


IMPORT_TESTS = f"import runpy\nrunpy.run_path({str(TESTS / 'paths.py')!r})['import_tests_package']()\n"
"""Python source that opens a ``python -c`` child which imports the test helpers."""


def repo_root_entries(path: list[str]) -> list[str]:
    """The entries of ``path`` (a ``sys.path``) that name the repo root; ``""`` is the working directory."""
    root = str(REPO_ROOT)
    return [p for p in path if str(Path(p or ".").resolve()) == root]

"""Where the tests find the repository and the test vectors."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The repository's root (the folder holding ``pyproject.toml``)."""

VECTORS = REPO_ROOT / "tests" / "vectors"
"""Vectors made by LMCache 0.5.6 (``dev/make_vectors.py``), committed: every clone has them."""

SHARED_VECTORS = REPO_ROOT.parent / "shared" / "vectors"
"""Vectors made by the reference implementation, beside the clone when present (an extra check)."""

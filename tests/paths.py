"""Where the tests find the repository and the optional shared test vectors."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The repository's root (the folder holding ``pyproject.toml``)."""

SHARED_VECTORS = REPO_ROOT.parent / "shared" / "vectors"
"""Vectors made by the reference implementation, beside the clone when present."""

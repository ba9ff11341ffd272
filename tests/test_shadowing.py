"""The checkout never shadows an installed module (issue 33): its top-level ``kernels/`` is
``kvcodec.kernels`` only, and transformers' ``import kernels`` finds HuggingFace's distribution."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO_ROOT, repo_root_entries
from tests.tools.test_quality import SMALL_RUN, build_tiny_llama, write_texts

REPO_KERNELS = REPO_ROOT / "kernels"
"""The Triton sources: ``kvcodec.kernels`` once installed, never ``kernels``."""


def _hf_kernels_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_the_repo_root_is_not_an_import_path() -> None:
    assert repo_root_entries(sys.path) == [], sys.path


def test_import_kernels_is_never_the_repo_folder() -> None:
    spec = importlib.util.find_spec("kernels")
    if not _hf_kernels_installed():
        assert spec is None, spec
        return
    module = importlib.import_module("kernels")
    origin = Path(module.__file__).resolve()
    assert origin.parent != REPO_KERNELS, origin
    assert importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py").resolve() == origin


def test_kvcodec_kernels_is_the_repo_folder() -> None:
    import kvcodec.kernels

    assert Path(kvcodec.kernels.__file__).resolve() == REPO_KERNELS / "__init__.py"


def test_python_m_kvcodec_quality_from_the_repo_root(tmp_path: Path) -> None:
    """As a user types it in the checkout: ``python -m kvcodec quality --model`` (transformers
    imports ``kernels`` when it is installed) with the working directory first on ``sys.path``."""
    model = build_tiny_llama(tmp_path / "tiny-llama")
    texts = write_texts(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    argv = ["quality", "--model", str(model), "--text", *texts, *SMALL_RUN, "--scopes", "per_tensor"]
    proc = subprocess.run(
        [sys.executable, "-m", "kvcodec", *argv, "--json", str(tmp_path / "q.json")],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "q.json").read_text())["passed"] is True


@pytest.mark.skipif(not _hf_kernels_installed(), reason="HuggingFace's kernels is not installed here")
def test_a_child_in_the_repo_root_imports_hf_kernels() -> None:
    """A ``python -c`` child started in the root (as the tests start theirs) sees the installed one."""
    code = "import kernels; print(kernels.__file__)"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Path(proc.stdout.strip()).resolve().parent != REPO_KERNELS

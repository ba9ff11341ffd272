"""Importing kvcodec is cheap: no Triton, no CUDA initialisation; the format layer pulls in no torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.paths import REPO_ROOT

ROOT = REPO_ROOT

# One fresh interpreter (torch's import dominates the cost), checked after each import.
CHECK = textwrap.dedent(
    """
    import sys

    def check(what):
        triton = sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))
        assert not triton, f"{what} imported {triton}"
        torch = sys.modules.get("torch")
        assert torch is None or not torch.cuda.is_initialized(), f"{what} initialised CUDA"

    import kvcodec
    check("import kvcodec")
    import kvcodec.format
    check("import kvcodec.format")
    import kvcodec.kernels
    check("import kvcodec.kernels")
    import torch
    assert not torch.cuda.is_initialized()
    print("ok")
    """
)


def test_import_pulls_no_triton_and_no_cuda() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


LEAN = textwrap.dedent(
    """
    import sys
    import kvcodec.format
    from kvcodec.format import parse, serialize_header, Header, Hashes
    blob = b"not a blob"
    try:
        parse(blob)
    except kvcodec.CodecError:
        pass
    heavy = sorted(m for m in sys.modules if m in ("torch", "numpy", "triton", "kvcodec._cpu")
                   or m.startswith(("torch.", "kvcodec.codec", "kvcodec.backends")))
    print(heavy)
    """
)


def test_the_format_layer_imports_neither_torch_nor_the_extension() -> None:
    proc = subprocess.run([sys.executable, "-c", LEAN], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr

"""kvcodec.env.triton_interpret reads TRITON_INTERPRET exactly as Triton does, and is the only reader."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvcodec.env import triton_interpret
from tests.paths import REPO_ROOT

VALUES = [
    "1",
    "true",
    "TRUE",
    "True",
    "on",
    "ON",
    "yes",
    "y",
    "Y",
    "0",
    "false",
    "off",
    "no",
    "",
    " 1",
    "1 ",
    "2",
]
ON = {"1", "true", "TRUE", "True", "on", "ON", "yes", "y", "Y"}


@pytest.mark.parametrize("value", VALUES)
def test_values(value: str) -> None:
    assert triton_interpret({"TRITON_INTERPRET": value}) is (value in ON)


def test_unset_is_off() -> None:
    assert triton_interpret({}) is False


@pytest.mark.parametrize("value", VALUES)
def test_agrees_with_triton(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    triton = pytest.importorskip("triton")
    if not hasattr(triton, "knobs"):
        pytest.skip("this Triton has no knobs module")
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_interpret() is bool(triton.knobs.runtime.interpret)


def test_no_other_module_parses_the_variable() -> None:
    """Every decision goes through kvcodec.env (the codec's plan cache may key on the raw value: it decides nothing)."""
    read = re.compile(r"environ(?:\.get)?[\[(]\s*[\"']TRITON_INTERPRET[\"']")
    readers = []
    for root in ("kvcodec", "kernels"):
        for path in sorted((REPO_ROOT / root).rglob("*.py")):
            if path.name == "env.py":
                continue
            rel = path.relative_to(REPO_ROOT).as_posix()
            readers += [f"{rel}: {ln.strip()}" for ln in path.read_text().splitlines() if read.search(ln)]
    assert all(r.startswith("kvcodec/codec/encode.py:") and "KVCODEC_BACKEND" in r for r in readers), readers


def test_importing_env_imports_neither_torch_nor_triton() -> None:
    # kvcodec/__init__ imports torch; load env.py on its own, as a file.
    env_py = Path(REPO_ROOT / "kvcodec" / "env.py")
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('kv_env', {str(env_py)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert 'torch' not in sys.modules and 'triton' not in sys.modules\n"
        "assert m.triton_interpret({'TRITON_INTERPRET': 'yes'})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

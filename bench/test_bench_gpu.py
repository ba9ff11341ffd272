"""dev/gpu_check.py without a GPU: clean exit, and its harness exercised on CPU (Triton interpreter)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("KVCODEC_AUTOTUNE", "0")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "dev" / "gpu_check.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvcodec_gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kvcodec_gpu_check"] = mod
    spec.loader.exec_module(mod)
    return mod


gc = _load()


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.skipif(_CUDA, reason="a GPU is present: the script would run for real")
def test_no_gpu_fails_clearly(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "cannot run: no CUDA GPU" in proc.stderr and "Nothing was checked" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_gpu_status_without_gpu() -> None:
    ok, why = gc.gpu_status()
    assert ok == _CUDA or "triton" in why
    if not _CUDA:
        assert "no CUDA GPU" in why


def test_kernels_shim_from_bare_tree() -> None:
    """From a checkout without the editable install, the script maps kernels/ to kvcodec.kernels."""
    code = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "kvcodec.kernels":
            raise ModuleNotFoundError(name)
        return None
sys.meta_path.insert(0, Block())
sys.path.insert(0, {str(ROOT / "dev")!r})
import gpu_check
gpu_check.ensure_kernels_importable()
import kvcodec.kernels.quant_triton as qt
assert qt.__file__.endswith("kernels/quant_triton.py"), qt.__file__
print("shim ok")
"""
    env = dict(_env(), TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "shim ok" in proc.stdout


def test_row_math_and_table() -> None:
    r = gc.Row("encode x", "encode", ms=2.0, copy_ms=1.8, moved_bytes=4_000_000, target=0.85)
    assert r.fraction == pytest.approx(0.9) and r.ok is True
    assert r.gbps == pytest.approx(2.0)
    slow = gc.Row("decode x", "decode", ms=4.0, copy_ms=1.0, moved_bytes=1, target=0.85)
    assert slow.ok is False
    info = gc.Row("variant", "encode", ms=1.0, copy_ms=1.0, moved_bytes=1)
    assert info.ok is None
    table = gc.format_table([r, slow, info], {"chunk": 3000.0})
    assert "encode x" in table and "NO" in table and "3000.0 GB/s" in table


@pytest.mark.interpreter
def test_builtin_checks_on_cpu() -> None:
    gc.ensure_kernels_importable()
    checks = gc.builtin_checks("cuda" if _CUDA else "cpu", quick=True)
    assert checks and all(c["ok"] for c in checks), [c for c in checks if not c["ok"]]


@pytest.mark.interpreter
def test_benchmark_harness_on_cpu(tmp_path: Path) -> None:
    """The whole benchmark path at toy sizes (CPU timer), then the JSON summary."""
    gc.ensure_kernels_importable()
    sizes = gc.QUICK_SIZES
    dev = "cuda" if _CUDA else "cpu"
    timer = gc.Timer(dev, warmup=0, reps=1, flush_mb=1)
    rows, copy_bw, extra = gc.run_benchmarks(dev, sizes, timer)
    kinds = {r.kind for r in rows}
    assert kinds == {"encode", "decode", "gather", "planes"}
    assert all(r.ms > 0 and r.fraction > 0 for r in rows)
    assert len(copy_bw) == 3
    host = extra["host"]
    assert host["layers"] == 2 and host["total_us"] > 0 and "ok" in host
    summary = gc.summarize(
        device_name="cpu-interpreter",
        checks=[{"check": "x", "ok": True, "error": "", "s": 0}],
        tests={"ran": False},
        rows=rows,
        copy_bw=copy_bw,
        extra=extra,
        elapsed_s=1.0,
    )
    path = tmp_path / "s.json"
    path.write_text(json.dumps(summary))
    back = json.loads(path.read_text())
    assert back["checks_ok"] and back["tests_ok"] and len(back["bench"]) == len(rows)
    assert extra["errors"] == []
    # Autotuning itself needs a GPU; here the heuristic runs.
    head = gc.autotuned_headline(dev, sizes, timer)
    assert [r.name.endswith("autotuned") for r in head] == [True] * 4
    # Over budget: optional parts are skipped and said so.
    rows2, _, extra2 = gc.run_benchmarks(dev, sizes, timer, budget_s=0.0)
    assert extra2["skipped"] and len(rows2) < len(rows)


def test_pytest_tier_reports_missing_or_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pytest" else real(name, *a)
    )
    res = gc.run_pytest(["tests/kernels/test_cuda.py"], timeout_s=60)
    assert res == {"ran": False, "reason": "pytest is not installed (built-in checks cover the kernels)"}
    monkeypatch.undo()
    res = gc.run_pytest(["tests/kernels/test_cuda.py"], timeout_s=120)
    assert res["ran"] and res["rc"] in (0, 5)  # 5: everything skipped (no GPU)
    assert res["failed"] == 0


@pytest.mark.interpreter
@pytest.mark.skipif(_CUDA, reason="the CPU smoke run is for machines without a GPU")
def test_main_smoke_run_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """main() end to end on CPU at toy sizes: checks, table, host line, JSON summary."""
    out = tmp_path / "gpu-check.json"
    rc = gc.main(["--device", "cpu", "--quick", "--skip-tests", "--skip-tune", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "benchmark" in text and "host CPU per 2-layer chunk" in text and "wrote" in text
    summary = json.loads(out.read_text())
    assert summary["checks_ok"] and summary["tests"] == {"ran": False, "reason": "--skip-tests"}
    assert {r["kind"] for r in summary["bench"]} == {"encode", "decode", "gather", "planes"}
    assert "launch_us" in summary["host"] and summary["copy_GBps"]


@pytest.mark.interpreter
def test_benchmark_errors_are_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing kernel is reported in the summary; the other benchmarks still run."""
    gc.ensure_kernels_importable()
    from kvcodec.kernels import fused_triton

    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("compile failed")

    monkeypatch.setattr(fused_triton, "encode_fused_layers", boom)
    dev = "cuda" if _CUDA else "cpu"
    rows, copy_bw, extra = gc.run_benchmarks(dev, gc.QUICK_SIZES, gc.Timer(dev, warmup=0, reps=1, flush_mb=1))
    assert any("compile failed" in e for e in extra["errors"])
    assert any(r.kind == "gather" for r in rows) and any(r.kind == "decode" for r in rows)
    summary = gc.summarize(
        device_name="x",
        checks=[],
        tests={"ran": False},
        rows=rows,
        copy_bw=copy_bw,
        extra=extra,
        elapsed_s=0.0,
    )
    assert summary["errors"] and not summary["ok"]

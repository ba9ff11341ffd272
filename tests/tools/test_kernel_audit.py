"""The kernel audit (dev/kernel_audit.py) and kvcodec tune: parsing, rules, budget, and real AOT compiles.

The real compiles run in a subprocess without TRITON_INTERPRET (the test
session sets it on machines without a GPU); they need triton and its
bundled cuobjdump, no GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
BUDGET = ROOT / "bench" / "kernel_budget.json"
AUDIT = ROOT / "dev" / "kernel_audit.py"


def _load_audit() -> ModuleType:
    """dev/kernel_audit.py, a developer tool outside the installed package, loaded by path."""
    spec = importlib.util.spec_from_file_location("kvcodec_dev_kernel_audit", AUDIT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


A = _load_audit()

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                      /* 0x00000a00ff017b82 */
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;            /* 0x0000000402047981 */
        /*0020*/              @!P0 LDG.E.U16 R8, desc[UR4][R2.64] ;
        /*0030*/                   STG.E.U8 desc[UR4][R2.64], R9 ;
        /*0040*/               @P1 STG.E.128 desc[UR4][R2.64], R4 ;
        /*0050*/                   STL.64 [R1], R4 ;
        /*0060*/                   LDL R4, [R1] ;
        /*0070*/                   STG.E desc[UR4][R2.64], R9 ;
        /*0080*/                   NOP ;
        /*0090*/                   EXIT ;
"""


def rec(**kw: object) -> A.Record:
    base = dict(
        key="w | k | sm_90 | 16x128/4w",
        workload="w",
        kernel="_k",
        arch=90,
        config="16x128/4w",
        ok=True,
        regs=40,
        shared=4096,
        sass=700,
        sass_per_elem=43.8,
        ld128=4,
        st128=3,
        ld_narrow=0,
        st_narrow=1,
        ldg={"128": 4},
        stg={"128": 3, "8": 1},
    )
    base.update(kw)
    return A.Record(**base)  # type: ignore[arg-type]


def test_parse_sass_counts_widths_and_spills() -> None:
    s = A.parse_sass(SASS)
    assert s["sass"] == 9  # NOP excluded, predicated instructions counted
    assert s["ldg"] == {"128": 1, "16": 1}
    assert s["stg"] == {"8": 1, "128": 1, "32": 1}
    assert s["spill_insts"] == 2


def test_parse_res_usage() -> None:
    text = " Function _k:\n  REG:40 STACK:8 SHARED:1024 LOCAL:16 CONSTANT[0]:664 TEXTURE:0"
    assert A.parse_res_usage(text) == {"regs": 40, "stack": 8, "shared_static": 1024, "local": 16}
    assert A.parse_res_usage("nothing")["regs"] == 0


def test_fp8_convert_facts() -> None:
    hw = "cvt.rn.satfinite.e4m3x2.f32 %rs1, %f2, %f1;\n cvt.f32.f16 %f3, %h1;"
    assert A.fp8_convert_facts(hw) == ("cvt.rn.satfinite.e4m3x2.f32", False)
    double = "cvt.rn.f16x2.f32 %r1, %f2, %f1;\n cvt.rn.satfinite.e4m3x2.f16x2 %rs1, %r1;"
    assert A.fp8_convert_facts(double) == ("", True)
    assert A.fp8_convert_facts("cvt.rz.f16x2.f32 %r1, %f2, %f1;")[1]


def test_rules() -> None:
    assert A.check([rec()], None) == []
    assert "compile failed" in A.check([rec(ok=False, error="boom")], None)[0].what
    assert "spills" in A.check([rec(spill_insts=2, local_bytes=16)], None)[0].what
    assert "no cvt" in A.check([rec(hw_fp8=True, encodes_fp8=True, fp8_cvt="")], None)[0].what
    v = A.check(
        [rec(hw_fp8=True, encodes_fp8=True, fp8_cvt="cvt.rn.satfinite.e4m3x2.f32", f16_step=True)], None
    )
    assert [x.what for x in v] == ["FP8 conversion rounds through fp16 (double rounding)"]
    assert "not vectorised" in A.check([rec(ld128=0)], None)[0].what
    assert A.check([rec(ld128=0, vec=False)], None) == []
    assert A.check([rec(st128=0, stg={})], None) == []  # no stores (atomics only): loads decide


def test_budget_regressions() -> None:
    r = rec()
    budget = {
        r.key: {
            "regs": 40,
            "sass_per_elem": 43.8,
            "ld_narrow": 0,
            "st_narrow": 1,
            "shared": 4096,
            "ld128": 4,
            "st128": 3,
        }
    }
    assert A.check([r], budget) == []
    assert A.check([rec(sass_per_elem=43.8 * 1.01)], budget) == []  # within the 2% slack
    cases = {
        "regs": rec(regs=41),
        "sass_per_elem": rec(sass_per_elem=46.0),
        "st_narrow": rec(st_narrow=5),
        "st128": rec(st128=2),
        "shared": rec(shared=8192),
    }
    for metric, bad in cases.items():
        v = A.check([bad], budget)
        assert len(v) == 1 and v[0].what.startswith(metric), (metric, v)
    assert A.check([rec(key="unbudgeted", regs=200)], budget) == []  # rules only for unknown keys


def test_update_budget_roundtrip(tmp_path: Path) -> None:
    b = A.update_budget(
        {"format": A.BUDGET_FORMAT, "triton": {"3.6": {"version": "3.6.0", "records": {"x": {}}}}},
        [rec(), rec(key="failed", ok=False)],
        "3.9.1",
    )
    assert set(b["triton"]) == {"3.6", "3.9"}
    sec = A.budget_section(b, "3.9.0")
    assert sec is not None and list(sec) == [rec().key] and sec[rec().key]["regs"] == 40
    p = tmp_path / "b.json"
    p.write_text(json.dumps(b))
    assert A.load_budget(p) == b
    assert A.budget_section(A.load_budget(tmp_path / "missing.json"), "3.9.0") is None
    p.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError):
        A.load_budget(p)


def test_table_marks_violations() -> None:
    good, bad = rec(), rec(key="b", workload="bad", regs=99)
    text = A.format_table([good, bad, rec(key="c", workload="broken", ok=False)], [A.Violation("b", "regs")])
    lines = text.splitlines()
    assert any(ln.startswith("!bad") for ln in lines) and any(ln.startswith(" w ") for ln in lines)
    assert "COMPILE FAILED" in text


def test_committed_budget_is_well_formed() -> None:
    b = A.load_budget(BUDGET)
    assert b["triton"], "bench/kernel_budget.json has no section"
    for mm, sec in b["triton"].items():
        assert sec["records"], mm
        for key, lim in sec["records"].items():
            assert " | sm_" in key and set(lim) == set(A.METRICS_MAX + A.METRICS_MIN)


def _run_audit(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, str(AUDIT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def test_audit_refuses_the_interpreter() -> None:
    pytest.importorskip("triton")
    proc = _run_audit("--quick", env_extra={"TRITON_INTERPRET": "1"})
    assert proc.returncode == 2 and "TRITON_INTERPRET" in proc.stderr


def test_audit_quick_real_compile(tmp_path: Path) -> None:
    """Five real sm_90 compiles: hardware FP8 converts, no spills, 128-bit loads (Triton's cache makes reruns fast)."""
    pytest.importorskip("triton")
    out = tmp_path / "audit.json"
    proc = _run_audit("--quick", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = json.loads(out.read_text())["records"]
    assert len(recs) == 5 and all(r["ok"] for r in recs)
    enc = [r for r in recs if r["encodes_fp8"]]
    assert enc and all(
        r["fp8_cvt"].startswith("cvt.rn.satfinite.e4m3x2.f32") and not r["f16_step"] for r in enc
    )
    assert all(r["spill_insts"] == 0 and r["ld128"] > 0 for r in recs)
    # The integer emulation (sm_80's path) is what KVCODEC_HW_FP8=0 plans: no hardware cvt.
    proc = _run_audit("--quick", "--rules-only", "--json", str(out), env_extra={"KVCODEC_HW_FP8": "0"})
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert all(not r["fp8_cvt"] for r in json.loads(out.read_text())["records"])


@pytest.mark.slow
def test_audit_default_run_meets_the_budget() -> None:
    """What `make kernel-audit` runs: every headline launch for sm_90 against bench/kernel_budget.json."""
    pytest.importorskip("triton")
    proc = _run_audit()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 with violations" in proc.stdout


# ----------------------------------------------------------------------------
# kvcodec tune
# ----------------------------------------------------------------------------


def test_tune_without_gpu_says_so() -> None:
    pytest.importorskip("triton")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvcodec.tools.tune"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr


def test_tune_parser_registers_on_a_cli() -> None:
    import argparse

    from kvcodec.tools import tune as T

    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command")
    T.add_parser(sub)
    args = p.parse_args(["tune", "--model", "llama-3-8b", "--out", "x.json", "--dry-run"])
    assert args.func is T.run and args.out == Path("x.json") and args.dry_run
    assert T._shape(args) == T.PRESETS["llama-3-8b"]
    args = p.parse_args(["tune", "--dry-run", "--head-dim", "64"])
    assert T._shape(args).dim == 64 and T._shape(args).layers == T.DRY_RUN_SHAPE.layers


@pytest.mark.interpreter
def test_tune_dry_run_checks_every_config(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under the interpreter every config of every kernel is run and compared with the reference."""
    pytest.importorskip("triton")
    from kvcodec.kernels.launch import INTERPRET

    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 before kvcodec.kernels is imported")
    from kvcodec.kernels import configs

    from kvcodec.tools import tune as T

    shape = T.Shape(layers=2, tokens=8, heads=1, dim=16, page_size=4, block_size=4)
    results = T.tune(shape, "cpu", dry_run=True)
    kernels = {r.kernel for r in results}
    assert {
        "_encode_groups_kernel",
        "_amax_tiles_kernel",
        "_quant_tiles_kernel",
        "_dequant_tiles_kernel",
    } <= kernels
    assert all(r.checked >= 1 and not r.failed for r in results)
    # A config whose output is wrong is caught before any timing.
    real_cases = T._cases

    def decode_config_tried() -> bool:
        return configs.overridden("_dequant_tiles_kernel") is not None

    def sabotaged(shape: T.Shape, device: str) -> list[T._Case]:
        cases = real_cases(shape, device)
        for c in cases:
            c.ok = (lambda ok: lambda: ok() and not decode_config_tried())(c.ok)
        return cases

    monkeypatch.setattr(T, "_cases", sabotaged)
    results = T.tune(shape, "cpu", dry_run=True)
    dec = [r for r in results if r.kernel == "_dequant_tiles_kernel"]
    assert dec and any("differs from the reference" in f for f in dec[0].failed)
    text = T.format_results(results, dry_run=True)
    assert "FAILED" in text


# ----------------------------------------------------------------------------
# Launch planning (recorded, nothing runs): what the audit compiles
# ----------------------------------------------------------------------------


def _plan(target: object, fn: object) -> list[object]:
    from kvcodec.kernels import launch

    with launch.recording(target) as launches:  # type: ignore[arg-type]
        fn()  # type: ignore[operator]
    return launches


def test_recording_plans_hardware_fp8_by_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    import torch
    from kvcodec.kernels import fused_triton, launch, operands

    from kvcodec.format import ScaleScope

    k = torch.zeros(2, 32, 2, 64, dtype=torch.float16)
    pays = operands.empty_payloads(
        2, operands.payload_nbytes(k[0], k[0], ScaleScope.PER_PAGE_HEAD, 16), "cpu"
    )

    def enc() -> None:
        fused_triton.encode_fused_layers(k, k, ScaleScope.PER_PAGE_HEAD, page_size=16, payloads=pays)

    for cap, hw in (((8, 0), False), ((8, 9), True), ((9, 0), True), ((10, 0), True)):
        (ln,) = _plan(launch.Target(False, 132, cap, "sim"), enc)
        assert ln.kwargs["HW_FP8"] is hw, cap
        # CUDA planning, not the interpreter's:
        assert ln.kwargs["num_warps"] > 1 and ln.kwargs["BLOCK_T"] == 16
    monkeypatch.setenv("KVCODEC_HW_FP8", "0")
    (ln,) = _plan(launch.H200, enc)
    assert ln.kwargs["HW_FP8"] is False
    (ln,) = _plan(launch.INTERPRETER, enc)
    assert ln.kwargs["HW_FP8"] is False and ln.kwargs["num_warps"] == 1


def test_padded_payloads_and_aligned_layer_tables() -> None:
    pytest.importorskip("triton")
    import torch
    from kvcodec.kernels import fused_triton, launch, operands

    from kvcodec.format import ScaleScope

    p = operands.empty_payloads(3, 1000, "cpu")
    assert p.shape == (3, 1000) and p.stride(0) % 16 == 0 and p.stride(0) >= 1000
    T, H, D = 16, 2, 64
    buf = torch.zeros(4096 * 8, dtype=torch.float16)
    aligned = [buf[o : o + T * H * D].view(T, H, D) for o in (0, 4096, 3 * 4096 + 8)]  # uneven: a table
    skewed = [buf[o : o + T * H * D].view(T, H, D) for o in (0, 4097, 3 * 4096 + 8)]
    nb = operands.payload_nbytes(aligned[0], aligned[0], ScaleScope.PER_TENSOR, None)
    for ks, want in ((aligned, 8), (skewed, 1)):
        lns = _plan(
            launch.H200,
            lambda ks=ks: fused_triton.encode_fused_layers(
                ks, aligned, ScaleScope.PER_TENSOR, payloads=operands.empty_payloads(3, nb, "cpu")
            ),
        )
        amax = next(ln for ln in lns if "TT" in ln.kwargs)
        assert amax.kwargs["K_TAB"] == want and amax.kwargs["V_TAB"] == 8
        # Padded stacked payloads: a stride, no table.
        assert amax.kwargs["P_TAB"] == 0 and amax.kwargs["p_sl"] % 16 == 0


def test_launch_pins_fp_fusion_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcodec.kernels import launch

    seen: dict[str, object] = {}

    class Fake:
        def __getitem__(self, grid: object) -> object:
            return lambda **kw: seen.update(kw, grid=grid)

    monkeypatch.setattr(launch, "INTERPRET", False)
    launch.launch(Fake(), (1, 2, 3), {"x": 1})
    assert seen == {"x": 1, "enable_fp_fusion": False, "grid": (1, 2, 3)}


def test_tuning_file_config_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    import torch
    import triton
    from kvcodec.kernels import configs, fused_triton, launch, operands

    from kvcodec.format import ScaleScope

    k = torch.zeros(256, 8, 128, dtype=torch.float16)
    pay = torch.empty(operands.payload_nbytes(k, k, ScaleScope.PER_PAGE_HEAD, 16), dtype=torch.uint8)

    def enc() -> None:
        fused_triton.encode_fused(k, k, ScaleScope.PER_PAGE_HEAD, page_size=16, payload=pay)

    target = launch.Target(False, 132, (9, 0), "Some GPU")
    (ln,) = _plan(target, enc)
    default = configs.TileConfig(ln.kwargs["BLOCK_T"], ln.kwargs["num_warps"])
    assert default == configs.heuristic(16, 128)
    key = configs.shape_key("_encode_groups_kernel", ln.kwargs, 16)
    table = configs.TuningTable()
    table.put("Some GPU", triton.__version__, "_encode_groups_kernel", key, configs.TileConfig(16, 2), us=1.0)
    path = tmp_path / "tuning.json"
    table.save(path)
    monkeypatch.setenv("KVCODEC_TUNING_FILE", str(path))
    configs.reload_tuning()
    try:
        (ln,) = _plan(target, enc)
        assert (ln.kwargs["BLOCK_T"], ln.kwargs["num_warps"]) == (16, 2)
        (ln,) = _plan(launch.Target(False, 132, (9, 0), "Other GPU"), enc)  # keyed by GPU name
        assert configs.TileConfig(ln.kwargs["BLOCK_T"], ln.kwargs["num_warps"]) == default
        assert configs.TuningTable.load(path).to_json() == table.to_json()
        path.write_text("{not json")
        assert len(configs.TuningTable.load(path)) == 0  # a broken file never breaks launches
    finally:
        configs.reload_tuning()

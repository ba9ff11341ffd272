"""The CI performance gate's logic (bench/gate.py) on synthetic results: no timing here.

The end-to-end check (a real injected 1.5x slowdown failing the gate, a second
normal run passing it) is a benchmark run, `make bench-gate-selftest`, recorded
in bench/README.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
sys.path.insert(0, str(ROOT / "bench"))
import gate  # noqa: E402


def _results(**ratios: float) -> dict:
    return {
        "benchmarks": [
            {"name": n, "extra_info": {"speedup_kvcodec_vs_yardstick": r, "kvcodec_ms": 1.0}}
            for n, r in ratios.items()
        ]
    }


def _write(tmp_path: Path, name: str, data: dict) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(data))
    return p


def test_gate_passes_noise_and_fails_real_drop(tmp_path, capsys):
    base = tmp_path / "baseline.json"
    assert (
        gate.main(
            [
                str(_write(tmp_path, "a.json", _results(enc=0.20, dec=0.40))),
                "--baseline",
                str(base),
                "--update",
            ]
        )
        == 0
    )
    assert json.loads(base.read_text()) == {
        "dec": {"speedup_kvcodec_vs_yardstick": 0.4},
        "enc": {"speedup_kvcodec_vs_yardstick": 0.2},
    }
    noisy = _write(tmp_path, "b.json", _results(enc=0.17, dec=0.45))  # -15%: noise
    assert gate.main([str(noisy), "--baseline", str(base)]) == 0
    slow = _write(tmp_path, "c.json", _results(enc=0.2 / 1.5, dec=0.45))  # 1.5x slower: a regression
    assert gate.main([str(slow), "--baseline", str(base)]) == 1
    assert "enc: speedup_kvcodec_vs_yardstick = 0.133, below 0.200" in capsys.readouterr().err
    missing = _write(tmp_path, "d.json", _results(dec=0.45))
    assert gate.main([str(missing), "--baseline", str(base)]) == 1


def test_gate_update_takes_min_and_check_takes_median(tmp_path):
    runs = [_write(tmp_path, f"r{i}.json", _results(enc=r)) for i, r in enumerate((0.2, 0.1, 0.3))]
    base = tmp_path / "baseline.json"
    assert gate.main([*map(str, runs), "--baseline", str(base), "--update"]) == 0
    assert json.loads(base.read_text())["enc"]["speedup_kvcodec_vs_yardstick"] == 0.1
    assert gate.merge([gate.ratios(json.loads(p.read_text())) for p in runs], "median") == {
        "enc": {"speedup_kvcodec_vs_yardstick": 0.2}
    }


def test_gate_unreadable_inputs(tmp_path):
    assert gate.main([str(tmp_path / "nope.json")]) == 2
    ok = _write(tmp_path, "a.json", _results(enc=0.2))
    assert gate.main([str(ok), "--baseline", str(tmp_path / "nope.json")]) == 2


def test_committed_baseline_is_well_formed():
    base = json.loads((ROOT / "bench" / "baseline.json").read_text())
    assert base and all(gate.GATED.match(k) for v in base.values() for k in v)


def test_only_yardstick_ratios_are_gated():
    """Wall-clock ratios against memcpy (and LMCache) are recorded for reading, never gated."""
    info = {
        "speedup_kvcodec_vs_yardstick": 2.0,
        "speedup_kvcodec_vs_memcpy": 0.4,
        "wall_speedup_kvcodec_vs_memcpy": 0.3,
    }
    assert gate.ratios({"benchmarks": [{"name": "enc", "extra_info": info}]}) == {
        "enc": {"speedup_kvcodec_vs_yardstick": 2.0}
    }

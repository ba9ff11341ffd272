"""Honest floors on V's FP8 error (e4m3 keeps 3 mantissa bits: ~31 dB on smooth data)."""

from __future__ import annotations

import pytest
import torch

from kvcodec.tools.quality import DISTRIBUTIONS, attention_error, make_v, quality_report, sqnr_db, v_metrics


@pytest.fixture(scope="module")
def rows():
    return {(r.distribution, r.scope): r for r in quality_report(tokens=256, heads=4, dim=64)}


def test_gaussian_floors(rows):
    for scope in ("per_tensor", "per_layer_head", "per_page_head"):
        r = rows[("gaussian", scope)]
        assert r.sqnr_db >= 28.0
        assert r.max_rel_err <= 0.0625 + 1e-6  # half an e4m3 ulp at 3 mantissa bits
        assert r.median_rel_err < 0.03
        assert r.attn_rel_err < 0.04


def test_heavy_tails_floor(rows):
    assert rows[("student_t3", "per_page_head")].sqnr_db >= 28.0


def test_per_page_head_beats_per_tensor_under_outliers(rows):
    pph, pt = rows[("outlier_channels", "per_page_head")], rows[("outlier_channels", "per_tensor")]
    assert pph.sqnr_db > pt.sqnr_db
    assert pph.attn_rel_err < 0.85 * pt.attn_rel_err


def test_metrics_sanity():
    v = make_v("gaussian", 32, 2, 16)
    assert sqnr_db(v, v) == float("inf")
    s, mx, med = v_metrics(v, v * 1.01)
    assert s == pytest.approx(40.0, abs=1e-3)
    assert mx == pytest.approx(0.01, rel=1e-4) and med == pytest.approx(0.01, rel=1e-4)
    assert attention_error(v, v) == 0.0
    assert attention_error(v, v * 1.1) == pytest.approx(0.1, rel=1e-6)
    for d in DISTRIBUTIONS:
        assert torch.isfinite(make_v(d, 40, 3, 8)).all()
    with pytest.raises(ValueError, match="unknown distribution"):
        make_v("uniform", 4, 1, 4)

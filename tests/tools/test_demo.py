"""The end-to-end demo: synthetic cache structure, store round trip, report, CLI wrapper."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcodec import UnsupportedConfigError
from kvcodec.format import parse
from kvcodec.store import DirectoryStore
from kvcodec.tools import demo
from kvcodec.tools.cli import main
from kvcodec.tools.demo import (
    MODEL_HASHES,
    DemoConfig,
    SyntheticKVCache,
    _sample_pairs,
    format_demo,
    run_demo,
)
from tests.tools.test_quality import build_tiny_llama, write_texts

SMALL: dict[str, Any] = {"layers": 4, "tokens": 512, "chunk_tokens": 128, "progress": False}


def test_synthetic_cache_is_deterministic_and_structured() -> None:
    c = SyntheticKVCache(layers=4, tokens=300, chunk_tokens=128, heads=8, head_dim=128, seed=1)
    assert c.chunks == 3 and c.chunk_len(2) == 44
    k1, v1 = c.chunk(2, 1)
    k2, v2 = SyntheticKVCache(layers=4, tokens=300, chunk_tokens=128, heads=8, head_dim=128, seed=1).chunk(
        2, 1
    )
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert k1.shape == (128, 8, 128) and k1.dtype == torch.float16
    assert not torch.equal(c.chunk(2, 0)[0], k1)
    # K: a few channels per head stand 10x+ above the typical one.
    ch = k1.float().abs().amax(dim=0)  # [heads, dim]
    ratio = ch.amax(dim=1) / ch.median(dim=1).values
    assert bool((ratio > 8).all())
    # V: no such outliers, but heads differ in scale.
    vch = v1.float().abs().amax(dim=0)
    assert bool((vch.amax(dim=1) / vch.median(dim=1).values < 4).all())
    std = v1.float().std(dim=(0, 2))
    assert std.max() / std.min() > 3
    # Deeper layers have larger K.
    assert c.chunk(3, 0)[0].float().abs().mean() > c.chunk(0, 0)[0].float().abs().mean()
    assert c.chunk(0, 2)[1].shape == (44, 8, 128)


def test_sample_pairs() -> None:
    pairs = _sample_pairs(32, 8, 8)
    assert len(pairs) == 8 and (0, 0) in pairs and (31, 7) in pairs
    assert len({layer for layer, _ in pairs}) == 8 and len({c for _, c in pairs}) == 8
    assert _sample_pairs(2, 2, 10) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert _sample_pairs(3, 3, 0) == set()


def test_run_demo_small(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    real_mkdtemp = demo.tempfile.mkdtemp

    def spy(**kw: Any) -> str:
        made.append(real_mkdtemp(**kw))
        return made[-1]

    monkeypatch.setattr(demo.tempfile, "mkdtemp", spy)
    r = run_demo(**SMALL)
    assert r["passed"], r["failures"]
    assert r["blobs"] == 16 and r["k_exact"] == 16
    assert 0.75 <= r["ratio"] <= 0.8
    assert r["bytes_before"] == 4 * 512 * 8 * 128 * 2 * 2
    bd = r["bytes_breakdown"]
    assert bd["k"] + bd["v"] + bd["scales"] + bd["headers"] == r["bytes_after"]
    assert bd["scales"] == 16 * (128 // 16) * 8 * 4
    assert r["hash_gate_ok"]
    assert 25 < r["v_sqnr_db"] < 40 and r["v_min_blob_sqnr_db"] > 25
    assert 0 < r["v_median_rel_err"] < 0.05 and r["v_max_rel_err"] < 0.1
    assert 0 < r["attn_rel_err_max"] < 0.05 and len(r["sampled"]) == 8
    assert r["encode_gbps"] > 0 and r["decode_gbps"] > 0
    assert r["store"] is None
    assert len(made) == 1 and not Path(made[0]).exists()  # the temp store is removed
    json.dumps(r)  # JSON-friendly
    table = format_demo(r)
    assert "PASS" in table and "K bit-exact" in table and "16/16" in table


def test_run_demo_store_kept_and_verifiable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "store"
    r = run_demo(**{**SMALL, "tokens": 300, "dtype": "bf16", "scope": "per_tensor"}, store=root)
    assert r["passed"], r["failures"]
    assert r["blobs"] == 12 and r["store"] == str(root)
    st = DirectoryStore(root)
    assert st.keys() == sorted(
        DirectoryStore.make_key(MODEL_HASHES, la, c) for la in range(4) for c in range(3)
    )
    assert {parse(st.get(k)).header.version for k in st.keys()} == {2}  # sealed by default
    assert r["version"] == 2 and "header v2" in format_demo(r)
    assert main(["verify", "--expect-model-id", MODEL_HASHES.model_id, "--strict-hashes", str(root)]) == 0
    assert capsys.readouterr().out.strip() == "verified 12 blobs: 12 ok, 0 bad"
    assert main(["verify", "--expect-model-id", "meta-llama/Meta-Llama-3-70B", str(root)]) == 1


def test_run_demo_detects_k_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    real = SyntheticKVCache.chunk
    calls = {"n": 0}

    def tampered(self: SyntheticKVCache, layer: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = real(self, layer, chunk)
        calls["n"] += 1
        if calls["n"] > self.layers * self.chunks and (layer, chunk) == (1, 1):  # read pass only
            k = k.clone()
            k.view(torch.int16).view(-1)[5] ^= 1
        return k, v

    monkeypatch.setattr(SyntheticKVCache, "chunk", tampered)
    r = run_demo(**{**SMALL, "layers": 2, "tokens": 256})
    assert not r["passed"] and r["k_exact"] == r["blobs"] - 1
    assert any("layer 1 chunk 1" in f and "bit-exact" in f for f in r["failures"])


def test_run_demo_sqnr_floor() -> None:
    r = run_demo(**{**SMALL, "layers": 1, "tokens": 128}, min_sqnr_db=99.0)
    assert not r["passed"] and "SQNR" in r["failures"][0]


def test_demo_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--layers", "2", "--tokens", "256", "--chunk-tokens", "128", "--json", "--no-progress"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["passed"] and r["k_exact"] == 4 and 0.75 <= r["ratio"] <= 0.8
    assert r["shape"]["layers"] == 2 and r["threads"] == 1


def test_demo_cli_table_and_failure_exit(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["demo", "--layers", "2", "--tokens", "256", "--chunk-tokens", "128", "--page-size", "32"]
    assert main([*base, "--progress"]) == 0
    out = capsys.readouterr().out
    for text in ("Meta-Llama-3-8B", "bytes before", "ratio", "K bit-exact", "SQNR", "throughput", "PASS"):
        assert text in out, text
    assert main([*base, "--min-sqnr-db", "99"]) == 1
    cap = capsys.readouterr()
    assert "FAIL" in cap.out and cap.err.startswith("kvcodec: error: demo: V SQNR")


def test_demo_config_and_keywords_agree() -> None:
    cfg = DemoConfig(layers=1, tokens=128, chunk_tokens=128, progress=False, version=1)
    r = run_demo(cfg, sample=1)
    assert r["passed"] and r["version"] == 1 and len(r["sampled"]) == 1
    assert r["shape"]["layers"] == 1 and r["blobs"] == 1


def test_demo_writes_version_1_on_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "s"
    argv = [
        "demo",
        "--layers",
        "1",
        "--tokens",
        "128",
        "--store",
        str(root),
        "--version",
        "1",
        "--no-progress",
    ]
    assert main(argv) == 0
    assert "header v1" in capsys.readouterr().out
    st = DirectoryStore(root)
    assert [parse(st.get(k)).header.version for k in st.keys()] == [1]


@pytest.mark.parametrize(
    "bad",
    [
        {"min_sqnr_db": float("nan")},
        {"min_sqnr_db": float("inf")},
        {"min_sqnr_db": -float("inf")},
        {"min_sqnr_db": "20"},
        {"layers": 0},
        {"tokens": 2.5},
        {"dtype": "fp8"},
        {"scope": "external"},
        {"version": 3},
        {"page_size": 2**62},
        {"chunk_tokens": 2**20, "tokens": 2**20, "heads": 64, "head_dim": 256},
        {"no_such_option": 1},
    ],
)
def test_demo_refuses_bad_settings_before_any_work(tmp_path: Path, bad: dict[str, Any]) -> None:
    root = tmp_path / "never"
    with pytest.raises(UnsupportedConfigError):
        run_demo(**{**SMALL, **bad}, store=root)
    assert not root.exists()


def test_nan_floor_no_longer_passes_everything() -> None:
    """A NaN floor made ``sqnr < floor`` always False, so every run passed; now it is refused."""
    with pytest.raises(UnsupportedConfigError, match="finite"):
        DemoConfig(min_sqnr_db=float("nan")).validate()


# ----------------------------------------------------------------------------- a real (tiny) model's KV


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_texts(tmp_path_factory.mktemp("texts"))


def test_demo_on_a_model_forward_pass(tiny_model: Path, texts: list[str]) -> None:
    """--model: K and V come from a forward pass (shape from the model), K bit-exact through the store."""
    r = run_demo(
        model=str(tiny_model), text=texts[0], tokens=100, chunk_tokens=32, dtype="bf16", progress=False
    )
    assert r["passed"], r["failures"]
    assert r["shape"] == {
        "layers": 2,
        "tokens": 100,
        "chunk_tokens": 32,
        "chunks": 4,
        "kv_heads": 2,
        "head_dim": 16,
        "page_size": 16,
    }
    assert r["k_exact"] == r["blobs"] == 8 and r["hash_gate_ok"]
    assert r["model"] == tiny_model.name and "forward pass over" in r["source"]
    assert 25 < r["v_sqnr_db"] < 45
    assert "forward pass over" in format_demo(r)


def test_demo_model_needs_text(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UnsupportedConfigError, match="model and text go together"):
        run_demo(model=str(tiny_model), progress=False)
    assert main(["demo", "--model", str(tiny_model)]) == 1
    assert "model and text go together" in capsys.readouterr().err

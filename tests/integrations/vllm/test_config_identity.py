"""Connector config refused at start (UnsupportedConfigError naming the key) and the model identity
(resolved paths, weights digest); no vLLM needed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvcodec import UnsupportedConfigError
from kvcodec.format.header import MAX_DIM, MAX_HASH_STR
from kvcodec.integrations.vllm.config import DEFAULT_PENDING_SAVE_BYTES, KvcodecConfig
from kvcodec.integrations.vllm.identity import CacheGeometry, identity, model_source


def _refused(extra: dict, match: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=match):
        KvcodecConfig.from_extra(extra)


def test_root_with_nul_is_refused() -> None:
    _refused({"root": "/tmp/a\x00b"}, "root .* NUL")


def test_root_that_is_a_file_or_under_one_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    _refused({"root": str(f)}, "root .* not a directory")
    _refused({"root": str(f / "store" / "deeper")}, "root .* not a directory")
    assert KvcodecConfig.from_extra({"root": str(tmp_path / "new" / "store")}).root.endswith("store")


def test_model_id_must_fit_a_blob_header() -> None:
    _refused({"root": "/x", "model_id": "bad\udc80id"}, "model_id .*UTF-8")
    _refused({"root": "/x", "model_id": "é" * (MAX_HASH_STR // 2 + 1)}, "model_id .*at most")
    assert KvcodecConfig.from_extra({"root": "/x", "model_id": "m" * MAX_HASH_STR}).model_id


def test_sizes_above_the_format_limits_are_refused() -> None:
    _refused({"root": "/x", "page_size": MAX_DIM + 1}, "page_size")
    _refused({"root": "/x", "chunk_size": MAX_DIM + 1}, "chunk_size")


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"root": "/x", "async_save": "yes"}, "async_save"),
        ({"root": "/x", "async_load": 1}, "async_load"),
        ({"root": "/x", "max_pending_save_bytes": 0}, "max_pending_save_bytes"),
        ({"root": "/x", "max_pending_save_bytes": 1.5}, "max_pending_save_bytes"),
        ({"root": "/x", "max_concurrent_loads": 0}, "max_concurrent_loads"),
        ({"root": "/x", "store_timeout_ms": True}, "store_timeout_ms"),
        ({"root": "/x", "store": 5}, "store"),
        ({"root": "/x", "key_prefix": ""}, "key_prefix"),
        ({"store": None}, "root"),
        ({"root": "/x", "save_queue": 8}, "unknown"),
        ({"root": "/x", "writer_threads": 0}, "writer_threads"),
        ({"root": "/x", "writer_threads": 1000}, "writer_threads"),
        ({"root": "/x", "fused": ["on"]}, "fused"),
        ({"root": ["/x"]}, "root"),
        ({"root": "/x\udc80"}, "root .*UTF-8"),
    ],
)
def test_bad_types_are_refused(extra: dict, match: str) -> None:
    _refused(extra, match)


def test_new_keys_have_their_defaults() -> None:
    cfg = KvcodecConfig.from_extra({"root": "/x"})
    assert (cfg.async_save, cfg.async_load, cfg.writer_threads) == (True, True, 2)
    assert (cfg.max_pending_save_bytes, cfg.max_concurrent_loads) == (DEFAULT_PENDING_SAVE_BYTES, 16)
    assert (cfg.store, cfg.store_timeout_ms, cfg.key_prefix, cfg.fleet_key_env) == (
        None,
        50,
        None,
        "KVCODEC_FLEET_KEY",
    )
    assert cfg.location == "/x"


def test_a_store_url_needs_no_root() -> None:
    cfg = KvcodecConfig.from_extra({"store": "redis://127.0.0.1:6379/0"})
    assert (cfg.root, cfg.location) == (None, "redis://127.0.0.1:6379/0")


# --------------------------------------------------------------------------- identity


def _checkpoint(path: Path, weights: bytes = b"w" * 100) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (path / "model.safetensors").write_bytes(weights)
    return path


def _vllm_config(model: str, quantization: str | None = None) -> SimpleNamespace:
    hf = SimpleNamespace(to_dict=lambda: {"rope_theta": 1e4}, quantization_config=None)
    mc = SimpleNamespace(
        model=model, revision=None, dtype=torch.bfloat16, hf_config=hf, quantization=quantization
    )
    return SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto"))


GEO = CacheGeometry(2, 64, 64, 32, torch.bfloat16, False)
CFG = KvcodecConfig.from_extra({"root": "/x"})


def test_two_spellings_of_one_checkpoint_share_the_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _checkpoint(tmp_path / "models" / "tiny")
    os.symlink(model, tmp_path / "link")
    monkeypatch.chdir(tmp_path)
    spellings = [str(model), "models/tiny", "./models/../models/tiny/", str(tmp_path / "link")]
    ids = [identity(_vllm_config(m), CFG, GEO, (0, GEO.num_kv_heads), GEO.num_kv_heads) for m in spellings]
    assert all(i == ids[0] for i in ids), ids
    assert ids[0]["model_id"] == str(model.resolve())
    assert ids[0]["model_revision_hash"].startswith("weights:")


def test_other_weights_under_the_same_path_get_another_identity(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "m")
    before = identity(_vllm_config(str(model)), CFG, GEO, (0, GEO.num_kv_heads), GEO.num_kv_heads)
    (model / "model.safetensors").write_bytes(b"w" * 101)
    after = identity(_vllm_config(str(model)), CFG, GEO, (0, GEO.num_kv_heads), GEO.num_kv_heads)
    assert before["model_revision_hash"] != after["model_revision_hash"]
    (model / "config.json").write_text(json.dumps({"hidden_size": 65}))
    assert (
        identity(_vllm_config(str(model)), CFG, GEO, (0, GEO.num_kv_heads), GEO.num_kv_heads)[
            "model_revision_hash"
        ]
        != after["model_revision_hash"]
    )


def test_quantization_and_tp_are_in_the_identity(tmp_path: Path) -> None:
    model = str(_checkpoint(tmp_path / "m"))
    base = identity(_vllm_config(model), CFG, GEO, (0, GEO.num_kv_heads), GEO.num_kv_heads)
    assert (
        identity(_vllm_config(model, quantization="fp8"), CFG, GEO, (0, GEO.num_kv_heads), GEO.num_kv_heads)
        != base
    )
    assert identity(_vllm_config(model), CFG, GEO, (0, 1), GEO.num_kv_heads) != base


def test_hub_ids_use_the_revision() -> None:
    assert model_source("org/model", "abc123").weights == "hub:abc123"
    assert model_source("org/model", None).weights == "hub:unpinned"

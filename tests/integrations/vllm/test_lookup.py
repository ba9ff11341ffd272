"""The scheduler's lookup: one manifest ``stat`` per chunk whatever the layer count, and config errors
raised by the connector's constructor (vLLM's base class, no engine)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base", reason="needs vLLM")

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvcodec import UnsupportedConfigError
from kvcodec.integrations.vllm.connector import KvcodecConnector
from kvcodec.integrations.vllm.keys import chunk_suffix, prefix_hashes
from kvcodec.store import DirectoryStore

CHUNK = 32


def _connector(root: Path, layers: int, **extra: object) -> KvcodecConnector:
    ktc = KVTransferConfig(
        kv_connector="KvcodecConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"root": str(root), "chunk_size": CHUNK, **extra},
    )
    hf = SimpleNamespace(to_dict=lambda: {"rope_theta": 1e4}, quantization_config=None)
    mc = SimpleNamespace(model="m", revision=None, dtype=torch.bfloat16, hf_config=hf, quantization=None)
    vcfg = SimpleNamespace(
        kv_transfer_config=ktc,
        model_config=mc,
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    spec = SimpleNamespace(num_kv_heads=2, head_size=64, head_size_v=64, dtype=torch.bfloat16, block_size=16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    kv_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=names)])
    return KvcodecConnector(vcfg, KVConnectorRole.SCHEDULER, kv_config)


def _request(tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        request_id="r",
        prompt_token_ids=tokens,
        prompt_embeds=None,
        lora_request=None,
        mm_features=None,
        cache_salt=None,
    )


@pytest.mark.parametrize("layers", [2, 32])
def test_lookup_stats_one_manifest_per_chunk(
    tmp_path: Path, layers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = _connector(tmp_path, layers)
    tokens = list(range(5, 5 + 4 * CHUNK + 3))
    hashes = prefix_hashes(tokens[: 4 * CHUNK], CHUNK)
    prefix = conn._manifest_key(0, hashes[0], None).split("-M-")[0]
    for c in range(3):  # chunks 0..2 have manifests; chunk 3 does not
        (tmp_path / f"{prefix}-M{chunk_suffix(c, hashes[c], hashes[c - 1] if c else None)}").write_bytes(b"x")
    calls = []
    real = DirectoryStore.contains
    monkeypatch.setattr(DirectoryStore, "contains", lambda self, key: calls.append(key) or real(self, key))
    n, load_async = conn.get_num_new_matched_tokens(_request(tokens), 0)
    assert (n, load_async) == (3 * CHUNK, True)
    assert len(calls) == 4 and all("-M-" in k for k in calls)  # three hits and the miss that ends them


def test_async_load_can_be_turned_off(tmp_path: Path) -> None:
    conn = _connector(tmp_path, 2, async_load=False)
    tokens = list(range(5, 5 + CHUNK + 3))
    h = prefix_hashes(tokens[:CHUNK], CHUNK)
    prefix = conn._manifest_key(0, h[0], None).split("-M-")[0]
    (tmp_path / f"{prefix}-M{chunk_suffix(0, h[0], None)}").write_bytes(b"x")
    assert conn.get_num_new_matched_tokens(_request(tokens), 0) == (CHUNK, False)


def test_constructor_refuses_bad_roots(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    for root in (f, f / "below", "bad\x00root"):
        with pytest.raises(UnsupportedConfigError, match="root"):
            _connector(root, 2)  # type: ignore[arg-type]

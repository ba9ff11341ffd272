"""The scheduler's lookup: one ``contains_many`` per prompt (a manifest per chunk whatever the layer count;
every blob on a store that loses single blobs), an unreachable store as a miss, the cap on concurrent
loads, and config errors raised by the connector's constructor (vLLM's base class, no engine)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base", reason="needs vLLM")

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvcodec import UnsupportedConfigError
from kvcodec.errors import Reason, StoreUnavailableError
from kvcodec.integrations.vllm.chunk_keys import ChunkRef, HeadSplit, is_manifest
from kvcodec.integrations.vllm.connector import KvcodecConnector
from kvcodec.integrations.vllm.keys import prefix_hashes
from kvcodec.integrations.vllm.worker import ConnectorParts
from tests.integrations.vllm.workers import HookedStore

CHUNK = 32


def _connector(
    root: Path, layers: int, parts: ConnectorParts | None = None, **extra: object
) -> KvcodecConnector:
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
    return KvcodecConnector(vcfg, KVConnectorRole.SCHEDULER, kv_config, parts=parts)


def _request(tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        request_id="r",
        prompt_token_ids=tokens,
        prompt_embeds=None,
        lora_request=None,
        mm_features=None,
        cache_salt=None,
    )


class CountingStore(HookedStore):
    """Counts ``contains_many`` calls and the keys asked; ``partial`` plays a store that may lose one
    blob of a chunk on its own (Redis LRU); ``down`` one whose server is unreachable."""

    def __init__(self, root: Path, partial: bool = False) -> None:
        super().__init__(root)
        self.partial_groups, self.down = partial, False
        self.calls: list[list[str]] = []

    def contains_many(self, keys: list[str]) -> list[bool]:
        self.calls.append(list(keys))
        if self.down:
            raise StoreUnavailableError("test: server down", reason=Reason.STORE_UNAVAILABLE)
        return self.inner.contains_many(keys)


def _mark(conn: KvcodecConnector, hashes: list[str], chunks: range, layers: int = 0) -> None:
    """Write chunk manifests (and ``layers`` blob keys each) as placeholder files."""
    for c in chunks:
        ref = ChunkRef.of(hashes, c)
        for key in [conn.keys.manifest(ref)] + [conn.keys.blob(0, lid, ref) for lid in range(layers)]:
            getattr(conn.store, "inner", conn.store).put(key, b"x")


@pytest.mark.parametrize("layers", [2, 32])
def test_lookup_is_one_call_of_one_manifest_per_chunk(tmp_path: Path, layers: int) -> None:
    store = CountingStore(tmp_path)
    conn = _connector(tmp_path, layers, ConnectorParts(store=store))
    tokens = list(range(5, 5 + 4 * CHUNK + 3))
    hashes = prefix_hashes(tokens[: 4 * CHUNK], CHUNK)
    _mark(conn, hashes, range(3))  # chunks 0..2 have manifests; chunk 3 does not
    n, load_async = conn.get_num_new_matched_tokens(_request(tokens), 0)
    assert (n, load_async) == (3 * CHUNK, True)
    (call,) = store.calls
    assert call[0].endswith("-G")  # the cache generation's check (no reset yet: the pointer, absent)
    # Per chunk a manifest per head split a TP size may have written (2 KV heads: 1 or 2 ranges).
    assert len(call) == 1 + 4 * 2 and all(is_manifest(k) for k in call[1:])


def test_a_store_that_loses_single_blobs_is_asked_for_every_blob(tmp_path: Path) -> None:
    """``partial_groups``: a chunk is present only when its manifest and every layer's blob are."""
    store = CountingStore(tmp_path, partial=True)
    conn = _connector(tmp_path, 2, ConnectorParts(store=store))
    tokens = list(range(5, 5 + 3 * CHUNK + 3))
    hashes = prefix_hashes(tokens[: 3 * CHUNK], CHUNK)
    _mark(conn, hashes, range(1), layers=2)
    _mark(conn, hashes, range(1, 3), layers=1)  # chunks 1 and 2 lost layer 1's blob
    assert conn.get_num_new_matched_tokens(_request(tokens), 0) == (CHUNK, True)
    # One call: per chunk the manifest and every layer's blob of this engine's own split (one range),
    # and the other split's manifest only (2 ranges); none is stored, so no second call.
    assert len(store.calls) == 1 and len(store.calls[0]) == 1 + 3 * ((1 + 2) + 1)


def test_a_chunk_stored_by_another_tp_size_is_asked_for_its_blobs_in_a_second_call(tmp_path: Path) -> None:
    """Chunk 1 was written split in 2 head ranges (another TP size): its manifest answers the first
    call, its blobs the second; then it hits from that split."""
    store = CountingStore(tmp_path, partial=True)
    conn = _connector(tmp_path, 2, ConnectorParts(store=store))
    tokens = list(range(5, 5 + 3 * CHUNK + 3))
    hashes = prefix_hashes(tokens[: 3 * CHUNK], CHUNK)
    _mark(conn, hashes, range(1), layers=2)
    inner, keys, ref = getattr(conn.store, "inner", conn.store), conn.keys, ChunkRef.of(hashes, 1)
    split = HeadSplit(2, 2)
    for key in [keys.manifest(ref, 2)] + [
        keys.part_blob(lid, ref, split, p) for lid in range(2) for p in range(2)
    ]:
        inner.put(key, b"x")
    assert conn.get_num_new_matched_tokens(_request(tokens), 0) == (2 * CHUNK, True)
    first, second = store.calls
    assert len(first) == 1 + 3 * ((1 + 2) + 1)
    assert second == [keys.manifest(ref, 2)] + [
        keys.part_blob(lid, ref, split, p) for p in range(2) for lid in range(2)
    ]


def test_an_unreachable_store_is_a_counted_miss(tmp_path: Path) -> None:
    store = CountingStore(tmp_path)
    conn = _connector(tmp_path, 2, ConnectorParts(store=store))
    tokens = list(range(5, 5 + CHUNK + 3))
    _mark(conn, prefix_hashes(tokens[:CHUNK], CHUNK), range(1))
    store.down = True
    assert conn.get_num_new_matched_tokens(_request(tokens), 0) == (0, False)
    meta = conn.build_connector_meta(_no_step())
    assert meta.lookups_unavailable == 1


def _no_step() -> SimpleNamespace:
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
    )


def test_loads_over_the_cap_are_asked_again_later(tmp_path: Path) -> None:
    """At ``max_concurrent_loads`` in flight a hit answers ``(None, False)``; once the worker reports
    a load received, the next lookup is served."""
    conn = _connector(tmp_path, 2, max_concurrent_loads=1)
    tokens = list(range(5, 5 + CHUNK + 3))
    _mark(conn, prefix_hashes(tokens[:CHUNK], CHUNK), range(1))
    blocks = SimpleNamespace(get_block_ids=lambda: ([0, 1, 2],))
    first, second = _request(tokens), SimpleNamespace(**{**vars(_request(tokens)), "request_id": "s"})
    assert conn.get_num_new_matched_tokens(first, 0) == (CHUNK, True)
    conn.update_state_after_alloc(first, blocks, CHUNK)
    assert conn.get_num_new_matched_tokens(second, 0) == (None, False)
    assert conn.build_connector_meta(_no_step()).loads_deferred == 1
    conn.update_connector_output(SimpleNamespace(finished_recving={"r"}))
    assert conn.get_num_new_matched_tokens(second, 0) == (CHUNK, True)


def test_async_load_can_be_turned_off(tmp_path: Path) -> None:
    conn = _connector(tmp_path, 2, async_load=False)
    tokens = list(range(5, 5 + CHUNK + 3))
    _mark(conn, prefix_hashes(tokens[:CHUNK], CHUNK), range(1))
    assert conn.get_num_new_matched_tokens(_request(tokens), 0) == (CHUNK, False)


def test_constructor_refuses_bad_roots(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    for root in (f, f / "below", "bad\x00root"):
        with pytest.raises(UnsupportedConfigError, match="root"):
            _connector(root, 2)  # type: ignore[arg-type]


def test_hooks_of_vllm_0_32_cache_hit_source_delivery_and_reset(tmp_path: Path) -> None:
    """A directory store's hits are DISK in vLLM's per-source metrics, any other store's
    EXTERNAL_UNSPECIFIED (vLLM's label for a remote store); a dropped save needs no delivery; a reset
    makes every chunk saved before it a miss."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    conn = _connector(tmp_path / "d", 2)
    assert conn.get_external_cache_hit_sources(_request([1]), 64) == {CacheHitSource.DISK: 64}
    other = _connector(tmp_path / "o", 2, ConnectorParts(store=CountingStore(tmp_path / "o")))
    assert other.get_external_cache_hit_sources(_request([1]), 64) == {
        CacheHitSource.EXTERNAL_UNSPECIFIED: 64
    }
    assert conn.requires_kv_delivery is False
    tokens = list(range(5, 5 + 2 * CHUNK + 3))
    _mark(conn, prefix_hashes(tokens[: 2 * CHUNK], CHUNK), range(2))
    assert conn.get_num_new_matched_tokens(_request(tokens), 0) == (2 * CHUNK, True)
    assert conn.reset_cache() is True
    assert conn.get_num_new_matched_tokens(_request(tokens), 0) == (0, False)


def test_hits_are_counted_under_the_tier_each_chunk_loads_from(tmp_path: Path) -> None:
    """With store tiers (a RAM tier in front of the directory), vLLM's per-source hit metrics get each
    chunk's tokens under its tier's source (RAM: HOST, directory: DISK), adding up to the hit."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from kvcodec.integrations.vllm.store_tiers import stores_of
    from tests.store.test_store import make_blob

    conn = _connector(tmp_path / "d", 2, host_cache_bytes=1 << 20)
    ram, disk = stores_of(conn.store)
    tokens = list(range(5, 5 + 3 * CHUNK + 3))
    refs = [ChunkRef.of(prefix_hashes(tokens[: 3 * CHUNK], CHUNK), c) for c in range(3)]
    ram.put(conn.keys.manifest(refs[0]), make_blob(64, 0, version=2))
    for ref in refs[1:]:
        disk.put(conn.keys.manifest(ref), make_blob(64, 1, version=2))
    req = _request(tokens)
    assert conn.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, True)
    assert conn.get_external_cache_hit_sources(req, 3 * CHUNK) == {
        CacheHitSource.HOST: CHUNK,
        CacheHitSource.DISK: 2 * CHUNK,
    }
    # Asked once per lookup: a second ask (or a count that does not add up) takes the store's one source.
    assert conn.get_external_cache_hit_sources(req, 3 * CHUNK) == {CacheHitSource.DISK: 3 * CHUNK}
    conn.store.close()

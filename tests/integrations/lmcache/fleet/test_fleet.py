"""kvcodec blobs in LMCache's distributed storage, with real servers on 127.0.0.1.

Two deployments: one Redis behind LMCache's ``resp`` adapter, and a 3-node Redis Cluster behind its
``valkey`` adapter (cluster mode, a per-model ``key_prefix``). Per deployment, host A's
``kvcodec-lmcache server`` (kvcodec serde) is filled by LMCache's own client; then fresh servers
(empty L1) stand for other hosts: B, configured as A, must hit and return K bit-exact and V within
FP8's bound; hosts configured with another model id, another page size or no serde must get
0 hits, leave the engine's blocks untouched and say why in their log. Every value on every Redis
node is read back and parsed as an LMCKV blob.

All servers start side by side (one module-scoped setup, a few minutes on 2 cores); each is stopped by PID.
"""

from __future__ import annotations

import re

import pytest

import kvcodec
from tests.integrations.lmcache.fleet import harness as h

MODEL = "fleet-test-model"
SEQS = 3  # x 4 chunks of 256 tokens = 12 objects per deployment
SERDE = {"type": "kvcodec", "head_dim": 128, "page_size": 16, "model": MODEL}
PREFIX = "llama-fleet"
TAG = "lmcache-mp:[2,4,256,8*128]:bfloat16:per_page_head/16"  # the object: 4 layers x 256 tokens x 8 heads x 128

READERS = {  # name -> (deployment, serde): the hosts that read what A stored
    "B": ("single", SERDE),
    "other_model": ("single", {**SERDE, "model": "fleet-test-other"}),  # same length: the same blob size
    "other_pages": ("single", {**SERDE, "page_size": 32}),
    "no_serde": ("single", None),
    "B_cluster": ("cluster", SERDE),
    "other_pages_cluster": ("cluster", {**SERDE, "page_size": 32}),
}
MISMATCHED = [n for n in READERS if n.startswith(("other_", "no_"))]


def _adapter(nodes: h.RedisNodes) -> dict:
    return nodes.valkey_adapter(key_prefix=PREFIX) if nodes.cluster else nodes.resp_adapter


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    work = tmp_path_factory.mktemp("fleet")
    with h.redis_single(work / "single") as single, h.redis_cluster(work / "cluster") as cluster:
        deployments = {"single": single, "cluster": cluster}
        adapters = {
            "A": h.adapter_json(_adapter(single), SERDE),
            "A_cluster": h.adapter_json(_adapter(cluster), SERDE),
        }
        adapters |= {
            name: h.adapter_json(_adapter(deployments[dep]), serde) for name, (dep, serde) in READERS.items()
        }
        with h.lmcache_servers(work, adapters) as servers:
            stores = [h.Step(n, "store", servers[n], work / f"ref-{n}.pt") for n in ("A", "A_cluster")]
            stored, _ = h.run_client(stores, work, SEQS)
            chunks = SEQS * stored["A"]["chunks_per_seq"]
            for nodes in deployments.values():
                h.wait_keys(nodes, chunks)
            values = {dep: nodes.values() for dep, nodes in deployments.items()}
            per_node = cluster.keys_per_node()
            loads = [
                h.Step(n, "load", servers[n], work / f"ref-{'A_cluster' if dep == 'cluster' else 'A'}.pt")
                for n, (dep, _) in READERS.items()
            ]
            loaded, _ = h.run_client(loads, work, SEQS)
            logs = {n: s.log_text() for n, s in servers.items()}
    yield {
        "stored": stored,
        "chunks": chunks,
        "values": values,
        "per_node": per_node,
        "loaded": loaded,
        "logs": logs,
    }


def test_a_stores_every_chunk(fleet):
    for name in ("A", "A_cluster"):
        assert all(s["ok"] for s in fleet["stored"][name]["stores"]), fleet["stored"][name]


@pytest.mark.parametrize("dep", ["single", "cluster"])
def test_every_value_in_redis_is_an_lmckv_blob_of_the_model(fleet, dep):
    values = fleet["values"][dep]
    assert len(values) == fleet["chunks"]
    for key, blob in values.items():
        assert blob[:5] == b"LMCKV", key
        header = kvcodec.parse(blob, strict=True).header
        assert header.hashes.model_id == MODEL and header.hashes.kv_layout == TAG
        assert (header.version, header.kv_head_count, header.head_dim, header.chunk_size) == (
            1,
            8,
            128,
            4 * 256,
        )
        assert len(blob) < 0.76 * 2 * 4 * 256 * 8 * 128 * 2  # K 16-bit + V 8-bit + scales, vs the raw object
        if dep == "cluster":
            assert key.startswith(PREFIX.encode() + b"@"), key


def test_cluster_keys_spread_over_every_node(fleet):
    assert len(fleet["per_node"]) == 3 and all(n > 0 for n in fleet["per_node"]), fleet["per_node"]


@pytest.mark.parametrize("name", ["B", "B_cluster"])
def test_another_host_loads_a_s_kv(fleet, name):
    for row in fleet["loaded"][name]["loads"]:
        assert row["hit_chunks"] == row["total_chunks"] == 4, row
        assert row["retrieved"] and row["k_exact"], row
        assert 0 < row["v_max_err"] <= row["v_bound"], row
    log = fleet["logs"][name]
    served = re.findall(r"Prefetch request completed.*?(\d+)/(\d+) retained keys \((\d+) L1, (\d+) L2\)", log)
    assert served and all(kept == asked == l2 for kept, asked, _, l2 in served), log[-3000:]


@pytest.mark.parametrize("name", MISMATCHED)
def test_mismatched_host_gets_no_hits_and_no_data(fleet, name):
    for row in fleet["loaded"][name]["loads"]:
        assert row["hit_chunks"] == 0, row
        assert row["untouched_zero"], row  # the engine's blocks were never written


@pytest.mark.parametrize(
    "name,why",
    [
        # blobs of the same size reach the serde, which names the difference
        (
            "other_model",
            r"codec hash mismatch on 'model_id': encoded='fleet-test-model', expected='fleet-test-other'",
        ),
        # a value of another size is refused by LMCache's adapter before any serde runs
        ("other_pages", r"GET: size header mismatch"),
        ("no_serde", r"GET: size header mismatch"),
        ("other_pages_cluster", r"Valkey GET failed .*Value size exceeds buffer capacity"),
    ],
)
def test_mismatch_says_why_in_the_log(fleet, name, why):
    assert re.search(why, fleet["logs"][name]), fleet["logs"][name][-3000:]

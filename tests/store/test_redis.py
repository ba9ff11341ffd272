"""RedisStore against a real redis-server on 127.0.0.1: names and hash slots, round trips, damaged and
evicted values, URLs and credentials (the contract suite is test_contract_redis.py; the fleet MAC and
outages are test_redis_mac.py and test_redis_outage.py)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvcodec.errors import CorruptEncodedKVError, Reason, StoreUnavailableError, UnsupportedConfigError
from kvcodec.integrations.vllm.chunk_keys import ChunkRef, group_of
from kvcodec.store import InvalidKeyError, StoreFullError, StoreOptions, open_store
from tests.raises import raises_reason
from tests.redis_servers import (
    chunk_keys,
    connector_keys,
    free_port,
    make_blob,
    redis_cluster,
    redis_missing,
    redis_single,
)

pytestmark = pytest.mark.skipif(redis_missing() is not None, reason=str(redis_missing()))

if redis_missing() is None:
    from redis.crc import key_slot

    from kvcodec.store.redis import RedisStore, RedisURL

OPTS = StoreOptions(group_of=group_of, timeout_s=2.0)
"""Generous: the machine running the tests may be busy (the outage tests use the default)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with redis_single(tmp_path_factory.mktemp("redis")) as srv:
        yield srv


@pytest.fixture
def store(server):
    with server.client() as c:
        c.flushall()
    with open_store(server.url, OPTS) as st:
        yield st


# --------------------------------------------------------------------------- names and slots


def test_a_chunks_keys_share_one_hash_slot(store) -> None:
    keys = chunk_keys(layers=12, chunk=3)
    names = [store.name_of(k) for k in keys]
    assert all(n.startswith("kvcodec:{C3-H") and n.endswith(k) for n, k in zip(names, keys))
    assert len({key_slot(n.encode()) for n in names}) == 1
    other = [store.name_of(k) for k in chunk_keys(layers=2, chunk=4)]
    assert {key_slot(n.encode()) for n in other} != {key_slot(names[0].encode())}


def test_without_group_of_each_key_is_its_own_group(server) -> None:
    with open_store(server.url, StoreOptions(timeout_s=2.0, key_prefix="plain")) as st:
        assert st.name_of("abc") == "plain:{abc}:abc"


def test_invalid_keys_and_prefixes_are_refused(store, server) -> None:
    for bad in ("", ".hidden", "a/b", "a{b}", "x" * 201):
        with raises_reason(InvalidKeyError, Reason.BAD_KEY):
            store.put(bad, make_blob(64, 0))
    for prefix in ("", "a b", "a{b", "x" * 101):
        with raises_reason(UnsupportedConfigError, Reason.BAD_VALUE):
            open_store(server.url, StoreOptions(key_prefix=prefix))


def test_prefixes_keep_stores_apart(server) -> None:
    with open_store(server.url, StoreOptions(key_prefix="model-a")) as a:
        with open_store(server.url, StoreOptions(key_prefix="model-b")) as b:
            a.put("k1", make_blob(64, 1))
            assert a.keys() == ["k1"] and b.keys() == [] and not b.contains("k1")
            with pytest.raises(KeyError):
                b.get("k1")


# --------------------------------------------------------------------------- reads, writes, round trips


def test_a_chunk_is_written_and_read_in_one_round_trip_each(store) -> None:
    keys = chunk_keys(layers=12, chunk=0)
    blobs = [make_blob(2048, i) for i in range(len(keys))]
    before = store.stats()["round_trips"]
    store.put_many(list(zip(keys, blobs)))
    assert store.stats()["round_trips"] == before + 1
    assert store.contains_many(keys) == [True] * len(keys)
    assert store.stats()["round_trips"] == before + 2
    parsed = store.get_parsed_many(keys)
    assert store.stats()["round_trips"] == before + 3
    assert [bytes(p.blob) for p in parsed] == blobs
    s = store.stats()
    assert s["bytes_written"] == s["bytes_read"] == sum(map(len, blobs))


def test_misses_are_key_errors_and_false(store) -> None:
    keys = chunk_keys(layers=3, chunk=0)
    store.put_many([(k, make_blob(128, i)) for i, k in enumerate(keys[:-1])])
    with pytest.raises(KeyError) as info:
        store.get_parsed_many(keys)
    assert info.value.args == (keys[-1],)
    assert store.contains_many(keys) == [True, True, True, False]
    assert store.delete(keys[0]) and not store.delete(keys[0])
    with pytest.raises(KeyError):
        store.get(keys[0])


def test_iter_keys_scans_every_page(store) -> None:
    keys = {f"k{i:05d}" for i in range(2500)}  # more than one SCAN page (count 1000)
    blob = make_blob(16, 0)
    store.put_many([(k, blob) for k in keys])
    before = store.stats()["round_trips"]
    assert set(store.iter_keys()) == keys
    assert store.stats()["round_trips"] - before >= 3
    assert store.keys() == sorted(keys)


def test_a_damaged_value_is_refused_with_the_parsers_reason_and_deleted(store, server) -> None:
    keys = chunk_keys(layers=2, chunk=0)
    good = make_blob(1024, 3)
    store.put_many([(k, good) for k in keys])
    flipped = bytearray(good)
    flipped[-1] ^= 0x40
    with server.client() as c:
        c.set(store.name_of(keys[1]), bytes(flipped))
        with raises_reason(CorruptEncodedKVError, Reason.CRC_MISMATCH):
            store.get_parsed_many(keys)
        assert c.exists(store.name_of(keys[1])) == 0 and c.exists(store.name_of(keys[0])) == 1
        c.set(store.name_of(keys[1]), good[:-10])
        with raises_reason(CorruptEncodedKVError, Reason.TRUNCATED_PAYLOAD):
            store.get_parsed(keys[1])
        c.set(store.name_of(keys[1]), good + b"xx")
        with raises_reason(CorruptEncodedKVError, Reason.SIZE_MISMATCH):
            store.get(keys[1])
        c.set(store.name_of(keys[1]), b"not a blob")
        with pytest.raises(CorruptEncodedKVError):
            store.get(keys[1])
        assert c.exists(store.name_of(keys[1])) == 0
    assert store.stats()["errors"] == 4


CHUNKS = 60


def test_maxmemory_eviction_never_yields_part_of_a_chunk(tmp_path: Path) -> None:
    """allkeys-lru evicts single values: a chunk that lost any blob is a KeyError, never a partial list.
    (4 MB, not less: a pipeline's query buffer counts against maxmemory and cannot be evicted.)"""
    extra = ["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"]
    with redis_single(tmp_path, extra) as srv, open_store(srv.url, OPTS) as st:
        for chunk in range(CHUNKS):  # ~60 x 5 x 32 KiB: far past 4 MB
            st.put_many([(k, make_blob(32 << 10, chunk)) for k in chunk_keys(layers=4, chunk=chunk)])
        whole = 0
        for chunk in range(CHUNKS):
            keys = chunk_keys(layers=4, chunk=chunk)
            try:  # (an EXISTS before it could race: replies take memory, Redis evicts between commands)
                parsed = st.get_parsed_many(keys)
            except KeyError as e:
                assert e.args[0] in keys
            else:
                assert [p.header.chunk_id for p in parsed] == [chunk] * len(keys)
                whole += 1
        assert whole >= 1 and whole < CHUNKS


def test_a_full_server_without_eviction_raises_store_full(tmp_path: Path) -> None:
    extra = ["--maxmemory", "1mb", "--maxmemory-policy", "noeviction"]
    with redis_single(tmp_path, extra) as srv, open_store(srv.url, OPTS) as st:
        with raises_reason(StoreFullError, Reason.STORE_FULL):
            for i in range(100):
                st.put(f"k{i}", make_blob(64 << 10, i))


# --------------------------------------------------------------------------- a cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with redis_cluster(tmp_path_factory.mktemp("cluster")) as cl:
        yield cl


def test_cluster_chunks_spread_over_nodes_one_round_trip_per_chunk(cluster) -> None:
    with open_store(cluster.url, OPTS) as st:
        assert st.cluster
        nodes, blobs = set(), {}
        for chunk in range(12):
            keys = chunk_keys(layers=4, chunk=chunk)
            blobs[chunk] = [make_blob(512, chunk * 10 + i) for i in range(len(keys))]
            before = st.stats()["round_trips"]
            st.put_many(list(zip(keys, blobs[chunk])))
            assert [bytes(p.blob) for p in st.get_parsed_many(keys)] == blobs[chunk]
            assert st.stats()["round_trips"] == before + 2
            nodes.add(cluster.node_of(st.name_of(keys[0])).port)
        assert len(nodes) > 1
        every = [k for c in range(12) for k in chunk_keys(layers=4, chunk=c)]
        assert sorted(st.iter_keys()) == sorted(every)
        assert st.used_memory() > 0


def test_a_plain_url_to_a_cluster_node_is_detected(cluster) -> None:
    with open_store(f"redis://127.0.0.1:{cluster.nodes[1].port}", OPTS) as st:
        keys = chunk_keys(layers=2, chunk=7)
        st.put_many([(k, make_blob(256, 7)) for k in keys])
        assert st.cluster and st.location.startswith("redis+cluster://")
        assert len(st.get_parsed_many(keys)) == len(keys)


# --------------------------------------------------------------------------- URLs and credentials


def test_urls_parse_and_bad_ones_are_refused() -> None:
    u = RedisURL.parse("rediss+cluster://alice:s3cret@h1:7000,h2:7001")
    assert (u.tls, u.cluster, u.nodes, u.username, u.password) == (
        True,
        True,
        (("h1", 7000), ("h2", 7001)),
        "alice",
        "s3cret",
    )
    assert "s3cret" not in u.location and "s3cret" not in repr(u)
    assert RedisURL.parse("redis://127.0.0.1:6379/3").db == 3
    for bad in (
        "http://h:1",
        "redis://h:1/0?timeout=5",
        "redis://h",
        "redis://h:x",
        "redis://h1:1,h2:2",
        "redis+cluster://h:1/2",
        "redis://h:1/x",
    ):
        with raises_reason(UnsupportedConfigError, Reason.BAD_VALUE) as info:
            RedisURL.parse(bad)
    with raises_reason(UnsupportedConfigError, Reason.BAD_VALUE) as info:
        RedisURL.parse("redis://bob:hunter2@h")
    assert "hunter2" not in str(info.value)


def test_a_password_from_the_url_or_the_environment_never_shows(tmp_path: Path, monkeypatch, caplog) -> None:
    with redis_single(tmp_path, password="hunter2") as srv:
        url = f"redis://:hunter2@127.0.0.1:{srv.port}/0"
        with open_store(url, OPTS) as st:
            st.put("k", make_blob(64, 0))
            assert st.contains("k")
            assert "hunter2" not in st.location + repr(st)
        monkeypatch.setenv("KVCODEC_REDIS_PASSWORD", "hunter2")
        with open_store(srv.url, OPTS) as st:
            assert st.contains("k")
        monkeypatch.setenv("KVCODEC_REDIS_PASSWORD", "wrong")
        with caplog.at_level(logging.WARNING), open_store(srv.url, OPTS) as st:
            with raises_reason(UnsupportedConfigError, Reason.STORE_AUTH) as info:  # no outage
                st.contains("k")
        assert "hunter2" not in str(info.value) + caplog.text and "wrong" not in caplog.text


def test_closed_store_refuses_calls(server) -> None:
    st = open_store(server.url, OPTS)
    st.put("k", make_blob(64, 0))
    st.close()
    st.close()
    with pytest.raises(UnsupportedConfigError):
        st.contains("k")


def test_importing_kvcodec_store_does_not_import_redis() -> None:
    code = "import sys, kvcodec, kvcodec.store; print('redis' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_connector_key_grammar_groups_a_chunk(store) -> None:
    keys: Any = connector_keys("m0")
    ref = ChunkRef(2, "abc", "def")
    names = [store.name_of(k) for k in (keys.blob(0, 5, ref), keys.rank_marker(0, ref), keys.manifest(ref))]
    assert {n.split("}")[0] for n in names} == {"kvcodec:{C2-Habc"}
    assert isinstance(store, RedisStore) and store.partial_groups


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_rediss_checks_the_servers_certificate(tmp_path: Path, monkeypatch) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    req = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)]
    req += ["-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(req, check=True, capture_output=True)
    tls_port = free_port()
    extra = ["--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    extra += ["--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]
    with redis_single(tmp_path, extra):
        url = f"rediss://127.0.0.1:{tls_port}/0"
        with open_store(f"{url}?ca_certs={cert}", OPTS) as st:
            st.put("k", make_blob(64, 0))
            assert st.contains("k") and st.location == url
        monkeypatch.setenv("KVCODEC_REDIS_CA_CERTS", str(cert))
        with open_store(url, OPTS) as st:
            assert st.contains("k")
        monkeypatch.delenv("KVCODEC_REDIS_CA_CERTS")
        with open_store(url, OPTS) as st:  # a certificate no system CA signed
            with raises_reason(StoreUnavailableError, Reason.STORE_UNAVAILABLE):
                st.contains("k")

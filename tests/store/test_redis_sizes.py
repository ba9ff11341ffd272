"""Values sized to Redis's allocator (issue 36, kvcodec/store/redis_values.py) on a real redis-server:
a value over its jemalloc class is stored as a head of exactly one class and a small tail (one MSET, one
slot), read back in one pipeline; every size around the class boundaries round-trips; damage in either
part is refused and removed; planted parts are read only as far as a valid one goes; a chunk missing a
tail is a miss; verify/inspect see the blobs; the fleet MAC covers the whole blob."""

from __future__ import annotations

import struct
import threading
import tracemalloc
from collections.abc import Iterator

import pytest
import torch

from kvcodec import encode
from kvcodec.errors import CorruptEncodedKVError, Reason
from kvcodec.format import Hashes, Header, ScaleScope, assemble, parse
from kvcodec.integrations.vllm.chunk_keys import group_of
from kvcodec.store import StoreOptions, open_store
from kvcodec.store.auth import ENVELOPE_LEN, ENVELOPE_MAGIC
from kvcodec.tools.cli import main
from tests.raises import raises_reason
from tests.redis_servers import RedisServer, chunk_keys, redis_cluster, redis_missing, redis_single

pytestmark = pytest.mark.skipif(redis_missing() is not None, reason=str(redis_missing()))

if redis_missing() is None:
    from kvcodec.store.redis_values import (
        FRAME_LEN,
        SDS_LARGE,
        SPLIT_MAGIC,
        TAIL_FRAME_LEN,
        head_len,
        size_class,
        tail_name,
    )

KEY = b"fleet-key-0123456789abcdef"
CLASSES = (98_304, 196_608, 786_432, 1_048_576)
DELTAS = (-31, -30, -11, -10, -9, 0, 1, 2, 200, 900)


def opts(fleet_key: bytes | None = None, prefix: str = "sizes") -> StoreOptions:
    return StoreOptions(group_of=group_of, timeout_s=5.0, fleet_key=fleet_key, key_prefix=prefix)


def exact_blob(n: int, seed: int) -> bytes:
    """A valid v2 blob of exactly ``n`` bytes (n >= 200): random fp16 K and V of equal length."""
    gen = torch.Generator().manual_seed(seed)
    for pad in range(4):
        h = Header(
            k_dtype=torch.float16,
            v_dtype=torch.float16,
            scale_scope=ScaleScope.EXTERNAL,
            version=2,
            chunk_id=seed,
            hashes=Hashes(model_id="m" + "x" * pad),
        )
        rest = n - len(assemble(h))
        if rest % 4 == 0:
            half = torch.randint(0, 256, (rest // 2,), generator=gen, dtype=torch.uint8).numpy().tobytes()
            blob = bytes(assemble(h, half, half[::-1]))
            if len(blob) == n:
                return blob
    raise AssertionError(f"no blob of {n} bytes")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[RedisServer]:
    with redis_single(tmp_path_factory.mktemp("redis")) as srv:
        yield srv


@pytest.fixture
def raw(server):
    with server.client() as c:
        c.flushall()
        yield c


# --------------------------------------------------------------------------- the layout


def test_the_allocator_model_is_the_servers(server, raw) -> None:
    """MEMORY USAGE of one key: the same key overhead plus ``size_class(n + 10)`` for every large value."""
    if not raw.info("memory")["mem_allocator"].startswith("jemalloc"):
        pytest.skip("this redis-server does not use jemalloc")
    name = "sizes:{g}:k"
    raw.set(name, b"x" * 70_000)
    overhead = raw.memory_usage(name) - size_class(70_000 + SDS_LARGE)
    for c in CLASSES:
        for n in (c - 11, c - 10, c - 9, c + 1, c + 5000):
            raw.set(name, b"x" * n)
            assert raw.memory_usage(name) == overhead + size_class(n + SDS_LARGE), n


def test_only_values_over_their_class_by_more_than_a_key_costs_are_split() -> None:
    assert head_len(787_290 + ENVELOPE_LEN) == 786_432 - SDS_LARGE - FRAME_LEN  # Llama-3-8B, keyed
    assert head_len(197_200) == 196_608 - SDS_LARGE - FRAME_LEN  # the bench model's layer blob
    assert head_len(786_422) is None and head_len(786_410) is None  # fits its class closely
    assert head_len(60_000) is None and head_len(4096) is None  # small: whole
    for c in CLASSES:
        for n in (c + d for d in DELTAS):
            held = head_len(n)
            if held is not None:
                assert size_class(held + FRAME_LEN + SDS_LARGE) == held + FRAME_LEN + SDS_LARGE
                assert 0 < n - held <= n // 4


@pytest.mark.parametrize("fleet_key", [None, KEY], ids=["bare", "mac"])
def test_every_size_around_the_class_boundaries_round_trips(server, raw, fleet_key) -> None:
    env = ENVELOPE_LEN if fleet_key else 0
    sizes = [c + d for c in CLASSES for d in DELTAS] + [65_526, 81_910, 81_930]
    with open_store(server.url, opts(fleet_key)) as st:
        for i, n in enumerate(sizes):
            keys = chunk_keys(layers=1, chunk=i)
            blob, manifest = exact_blob(n - env, i), exact_blob(300, i)
            st.put_many([(keys[0], blob), (keys[1], manifest)])
            name = st.name_of(keys[0])
            held = head_len(n)
            assert raw.exists(tail_name(name)) == (held is not None), n
            if held is not None:
                assert raw.strlen(name) == held + FRAME_LEN
                assert raw.getrange(name, env, env + 7) == SPLIT_MAGIC  # after a MAC envelope
                assert raw.strlen(tail_name(name)) == TAIL_FRAME_LEN + n - held
            trips = st.stats()["round_trips"]
            got = st.get_parsed_many(keys, max_bytes=len(blob))
            assert st.stats()["round_trips"] == trips + 1  # head and tail of every key: one pipeline
            assert [bytes(p.blob) for p in got] == [blob, manifest]
            assert bytes(st.get(keys[0])) == blob and bytes(st.get_named(name)) == blob
            assert st.keys().count(keys[0]) == 1  # the tail's name is no key


def test_a_split_chunk_round_trips_on_a_cluster(tmp_path) -> None:
    with redis_cluster(tmp_path) as cl, open_store(cl.url, opts(KEY)) as st:
        keys = chunk_keys(layers=4, chunk=7)
        blobs = [exact_blob(197_200, i) for i in range(4)] + [exact_blob(300, 9)]
        st.put_many(list(zip(keys, blobs)))
        name = st.name_of(keys[0])
        with cl.node_of(name).client() as c:
            assert c.exists(name, tail_name(name)) == 2
        trips = st.stats()["round_trips"]
        assert [bytes(p.blob) for p in st.get_parsed_many(keys, max_bytes=197_200)] == blobs
        assert st.stats()["round_trips"] == trips + 1
        assert st.delete(keys[0])
        with cl.node_of(name).client() as c:
            assert c.exists(name, tail_name(name)) == 0


def test_readers_see_whole_blobs_while_a_writer_replaces_them(server, raw) -> None:
    a, b = exact_blob(197_200, 1), exact_blob(197_200, 2)
    with open_store(server.url, opts(KEY)) as st:
        st.put("k", a)
        seen: list[bytes] = []
        errors: list[BaseException] = []
        done = threading.Event()

        def read() -> None:
            try:
                while not done.is_set():
                    seen.append(bytes(st.get_parsed("k").blob))
            except BaseException as e:  # reported below
                errors.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        try:
            for i in range(60):
                st.put("k", a if i % 2 else b)
        finally:
            done.set()
            reader.join()
    assert not errors and seen and set(seen) <= {a, b}


# --------------------------------------------------------------------------- damage and bounds


def _split_stored(server, fleet_key: bytes | None = None) -> tuple[object, list[str], list[bytes], str]:
    st = open_store(server.url, opts(fleet_key))
    keys = chunk_keys(layers=3, chunk=0)
    blobs = [exact_blob(197_200, i) for i in range(3)] + [exact_blob(300, 5)]
    st.put_many(list(zip(keys, blobs)))
    return st, keys, blobs, st.name_of(keys[1])


def _edit(raw, name: str, at: int, flip: int = 0x40) -> None:
    value = bytearray(raw.get(name))
    value[at] ^= flip
    raw.set(name, bytes(value))


def _tail_len(raw, name: str, delta: int | None = None, value: int | None = None) -> None:
    """Rewrite the tail length a head declares (``delta`` from the true one, or ``value``)."""
    head = bytearray(raw.get(name))
    (now,) = struct.unpack_from("<I", head, 16)
    struct.pack_into("<I", head, 16, now + delta if value is None else value)
    raw.set(name, bytes(head))


def _cut_tail(raw, name: str) -> None:
    raw.set(tail_name(name), raw.get(tail_name(name))[:-1])


def _tail_a_list(raw, name: str) -> None:
    raw.delete(tail_name(name))
    raw.rpush(tail_name(name), b"x")


DAMAGE = {
    # the blob's own checks: the value (its name) goes; its tail is left to the next write or eviction
    "head payload": (lambda raw, n: _edit(raw, n, FRAME_LEN + 5000), Reason.CRC_MISMATCH),
    "tail payload": (lambda raw, n: _edit(raw, tail_name(n), TAIL_FRAME_LEN + 3), Reason.CRC_MISMATCH),
    # the parts do not fit: both go
    "tail shorter than declared": (lambda raw, n: _tail_len(raw, n, delta=+1), Reason.TRUNCATED_PAYLOAD),
    "tail longer than declared": (lambda raw, n: _tail_len(raw, n, delta=-1), Reason.SIZE_MISMATCH),
    "no tail declared": (lambda raw, n: _tail_len(raw, n, value=0), Reason.SIZE_MISMATCH),
    "huge tail declared": (lambda raw, n: _tail_len(raw, n, value=1 << 31), Reason.SIZE_MISMATCH),
    "tail cut": (lambda raw, n: _cut_tail(raw, n), Reason.TRUNCATED_PAYLOAD),
    "tail appended to": (lambda raw, n: raw.append(tail_name(n), b"x"), Reason.SIZE_MISMATCH),
    "tail of another write": (lambda raw, n: _edit(raw, tail_name(n), 0), Reason.CORRUPT),
    "tail of 3 bytes": (lambda raw, n: raw.set(tail_name(n), b"abc"), Reason.TRUNCATED_PAYLOAD),
    "tail a list": (lambda raw, n: _tail_a_list(raw, n), Reason.WRONG_TYPE),
    "head frame cut": (lambda raw, n: raw.set(n, raw.get(n)[:12]), Reason.TRUNCATED_HEADER),
}


@pytest.mark.parametrize("what", sorted(DAMAGE))
def test_damage_in_either_part_is_refused_and_removed(server, raw, what) -> None:
    damage, reason = DAMAGE[what]
    st, keys, _, name = _split_stored(server)
    try:
        damage(raw, name)
        with raises_reason(CorruptEncodedKVError, reason):
            st.get_parsed_many(keys, max_bytes=197_200)
        assert raw.exists(name) == 0
        assert raw.exists(tail_name(name)) == (reason is Reason.CRC_MISMATCH)  # a tail that does not fit goes
        assert st.contains_many(keys) == [True, False, True, True]
        assert st.stats()["errors"] == 1
    finally:
        st.close()


def test_the_fleet_mac_covers_the_whole_blob(server, raw) -> None:
    """The stored parts rewritten to hold another valid blob (its last byte changed, its CRC made good
    again, the original's MAC kept): a keyless reader takes it, a keyed one refuses it (BAD_MAC)."""
    st, keys, blobs, name = _split_stored(server, KEY)
    try:
        head, tail = raw.get(name), raw.get(tail_name(name))
        assert head[:8] == ENVELOPE_MAGIC and head[ENVELOPE_LEN : ENVELOPE_LEN + 8] == SPLIT_MAGIC
        at, held = ENVELOPE_LEN + FRAME_LEN, len(head) - ENVELOPE_LEN - FRAME_LEN  # blob bytes in the head
        changed = bytearray(blobs[1])
        changed[-1] ^= 1
        other = resealed(changed)
        raw.set(name, head[:at] + other[:held])  # the envelope of blobs[1] (its MAC) and the frame kept
        raw.set(tail_name(name), tail[:TAIL_FRAME_LEN] + other[held:])
        with open_store(server.url, opts(None)) as keyless:  # trusts the store: the CRC holds
            assert bytes(keyless.get(keys[1])) == other != blobs[1]
        with raises_reason(CorruptEncodedKVError, Reason.BAD_MAC):
            st.get_parsed_many(keys, max_bytes=197_200)
        assert raw.exists(name) == 0 and not st.contains(keys[1])
        st.put(keys[1], blobs[1])  # the next write of the key replaces both parts
        assert bytes(st.get(keys[1])) == blobs[1]
    finally:
        st.close()


def resealed(blob: bytearray) -> bytes:
    """``blob``'s header and payload sealed again: a valid CRC over the changed bytes."""
    p = parse(blob, verify_crc=False)
    return bytes(assemble(p.header, p.k, p.v, p.scales))


def test_planted_oversized_parts_are_read_only_as_far_as_a_valid_part_goes(server, raw) -> None:
    st, keys, _, name = _split_stored(server)
    try:
        limit = 197_200 + ENVELOPE_LEN
        junk = b"\x01" * (8 << 20)
        raw.set(tail_name(name), raw.get(tail_name(name))[:TAIL_FRAME_LEN] + junk)
        raw.set(tail_name(st.name_of(keys[0])), junk)  # a planted tail under another key's tail name
        tracemalloc.start()
        try:
            with raises_reason(CorruptEncodedKVError, Reason.SIZE_MISMATCH):
                st.get_parsed_many(keys, max_bytes=197_200)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        per_key = (limit + FRAME_LEN + 1) + (TAIL_FRAME_LEN + limit // 4 + 1)
        assert st.stats()["bytes_read"] <= len(keys) * per_key
        framing = 64 << 10  # RESP's framing per reply, the request, the parse's small objects
        assert peak < len(keys) * per_key + framing, f"peak {peak} bytes for planted 8 MiB tails"
        assert raw.exists(name, tail_name(name)) == 0
    finally:
        st.close()


def test_a_head_whose_tail_was_evicted_is_a_miss_and_removed(server, raw) -> None:
    st, keys, _, name = _split_stored(server)
    try:
        raw.delete(tail_name(name))  # as allkeys-lru may evict one key alone
        assert st.contains_many(keys) == [True, False, True, True]  # the lookup sees it gone
        assert raw.exists(name) == 1
        with pytest.raises(KeyError) as info:  # a load that looked up before: a miss
            st.get_parsed_many(keys, max_bytes=197_200)
        assert info.value.args == (keys[1],)
        assert raw.exists(name) == 0 and st.contains_many(keys) == [True, False, True, True]
        assert st.stats()["errors"] == 0
        raw.delete(st.name_of(keys[0]))  # a head evicted alone: its tail is never read as a blob
        with pytest.raises(KeyError):
            st.get_parsed_many(keys, max_bytes=197_200)
        assert st.keys() == sorted([keys[2], keys[3]])
    finally:
        st.close()


# --------------------------------------------------------------------------- the command line


def encoded(layer: int) -> bytes:
    """A real layer blob of the bench model's geometry (256 tokens, 4 KV heads x 64, bf16): ~197 KB."""
    g = torch.Generator().manual_seed(layer)
    k, v = (torch.randn(256, 4, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    return bytes(encode(k, v, scope="per_page_head", page_size=16, hashes={"model_id": "m"}, layer_id=layer))


def test_verify_and_inspect_see_every_split_blob(server, raw, capsys) -> None:
    keys = chunk_keys(layers=3, chunk=0)
    with open_store(server.url, opts()) as st:
        st.put_many([(k, encoded(i)) for i, k in enumerate(keys)])
        name = st.name_of(keys[1])
    assert raw.exists(tail_name(name)) == 1
    assert len(raw.keys("sizes:*")) == 4 and len(raw.keys("sizes~t:*")) == 4  # tails outside `<prefix>:*`
    assert main(["verify", "--key-prefix", "sizes", "-v", server.url]) == 0
    assert "4 ok, 0 bad" in capsys.readouterr().out
    assert main(["inspect", "--key-prefix", "sizes", "--json", server.url]) == 0
    assert capsys.readouterr().out.count('"crc_ok": true') == 4
    _edit(raw, tail_name(name), TAIL_FRAME_LEN + 3)
    assert main(["verify", "--key-prefix", "sizes", server.url]) == 1
    out = capsys.readouterr().out
    assert "3 ok, 1 bad" in out and keys[1] in out and "CRC" in out


def test_a_split_value_planted_without_its_envelope_is_refused(server, raw) -> None:
    """A keyless writer's copy of a sealed head (the envelope cut off, the tail kept): BAD_MAC."""
    st, keys, _, name = _split_stored(server, KEY)
    try:
        raw.set(name, raw.get(name)[ENVELOPE_LEN:])
        assert st.contains_many(keys) == [True] * 4
        with raises_reason(CorruptEncodedKVError, Reason.BAD_MAC):
            st.get_parsed_many(keys, max_bytes=197_200)
        assert raw.exists(name) == 0
    finally:
        st.close()

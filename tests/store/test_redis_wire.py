"""The Redis store's own reads (kvcodec/store/redis_wire.py): RESP2 replies received into one buffer.

The reader is fed canned replies in random pieces (hypothesis): what it returns never depends on
how the bytes arrive; every reply no Redis gives for the command is refused, bounded. On a real
redis-server: wire and redis-py reads give the same bytes for whole and split values, MAC or not;
a password and a database are honoured; a restarted server's stale sockets are dropped."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.env import redis_read_ahead
from kvcodec.store import StoreOptions, open_store
from kvcodec.store.redis_wire import MAX_LINE, BadReply, Command, Part, Wire, receive
from tests.redis_servers import chunk_keys, make_blob, redis_missing, redis_single


class Pieces:
    """A socket whose ``recv_into`` hands out ``data`` in the given piece sizes, then EOF (or a timeout)."""

    def __init__(self, data: bytes, sizes: list[int] | None = None, then: str = "eof") -> None:
        self.data, self.at, self.sizes, self.then = data, 0, list(sizes or []), then

    def recv_into(self, mv: memoryview) -> int:
        if self.at >= len(self.data):
            if self.then == "timeout":
                raise TimeoutError("timed out")
            return 0
        n = min(len(mv), len(self.data) - self.at, self.sizes.pop(0) if self.sizes else 1 << 30)
        mv[:n] = self.data[self.at : self.at + n]
        self.at += n
        return n


def bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


GET = Command(("GETRANGE", "k", 0, 99), 100)
EXISTS = Command(("EXISTS", "k"))


def plain(replies: list) -> list:
    return [bytes(x.view()) if isinstance(x, Part) else x for x in replies]


def test_each_kind_of_reply() -> None:
    data = b":1\r\n" + bulk(b"abc") + b"$-1\r\n" + b"+OK\r\n" + b"-WRONGTYPE Operation against a key\r\n"
    got = receive(Pieces(data), [EXISTS, GET, GET, EXISTS, GET])
    assert got[:4] == [1, got[1], None, "OK"] and bytes(got[1].view()) == b"abc"
    assert isinstance(got[4], redis.exceptions.ResponseError) and str(got[4]).startswith("WRONGTYPE")
    assert got[1].view().readonly


def test_every_bulk_shares_one_buffer() -> None:
    a, b = receive(Pieces(bulk(b"x" * 50) + bulk(b"y" * 40)), [GET, GET])
    assert a.buf is b.buf and a.end < b.start


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"*2\r\n:1\r\n:2\r\n", "type"),  # an array: no read command answers one
        (bulk(b"z" * 101), "at most 100"),  # longer than GETRANGE 0 99 returns
        (b"$1_0\r\n" + b"z" * 10 + b"\r\n", "integer"),
        (b"$+10\r\n" + b"z" * 10 + b"\r\n", "integer"),
        (b"$-2\r\n", "at most"),
        (b"$3\r\nabcXY", "CRLF"),
        (b"$3\r\nabcXY" + b"z" * 40, "CRLF"),  # all of it in the buffer: the inline path refuses too
        (b":" + b"1" * 20 + b"\r\n", "integer"),
        (b":\r\n", "integer"),
        (b":" + b"9" * (MAX_LINE + 10), "line"),
        (bulk(b"abc") + b":1\r\n", "after the last reply"),
    ],
)
def test_a_reply_no_redis_gives_is_refused(data: bytes, why: str) -> None:
    with pytest.raises(BadReply, match=why):
        receive(Pieces(data), [GET])


def test_a_huge_declared_bulk_is_refused_before_anything_is_allocated() -> None:
    with pytest.raises(BadReply, match="at most 100"):
        receive(Pieces(b"$999999999999\r\n"), [GET])


@pytest.mark.parametrize(
    ("then", "error"), [("eof", redis.exceptions.ConnectionError), ("timeout", redis.exceptions.TimeoutError)]
)
def test_a_reply_cut_short_is_redis_pys_own_error(then: str, error: type) -> None:
    with pytest.raises(error):
        receive(Pieces(bulk(b"abcdef")[:6], then=then), [GET])


def test_a_buffer_past_the_up_front_bound_grows_only_as_replies_arrive() -> None:
    big = Command(("GETRANGE", "k", 0, 512 << 20), (512 << 20) + 1)
    got = receive(Pieces(bulk(b"q" * 3_000_000)), [big])
    assert bytes(got[0].view()) == b"q" * 3_000_000 and len(got[0].buf) < 8 << 20


replies = st.lists(
    st.one_of(
        # short ones take the inline path, long and negative ones the full parser: the same replies
        st.integers(-(10**18), 10**19 - 1).map(lambda n: (EXISTS, b":%d\r\n" % n, n)),
        st.binary(max_size=100).map(lambda b: (GET, bulk(b), b)),
        st.just((GET, b"$-1\r\n", None)),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(replies, st.lists(st.integers(1, 40), max_size=60))
def test_replies_do_not_depend_on_how_the_bytes_arrive(rs: list, sizes: list[int]) -> None:
    data = b"".join(r[1] for r in rs)
    assert plain(receive(Pieces(data, sizes), [r[0] for r in rs])) == [r[2] for r in rs]


@pytest.mark.parametrize(
    ("where", "here"),
    [
        ({"path": "/run/redis.sock"}, True),
        ({"host": "127.0.0.1", "port": 6379}, True),
        ({"host": "127.8.0.3", "port": 6379}, True),
        ({"host": "::1", "port": 6379}, True),
        ({"host": "[::1]", "port": 6379}, True),
        ({"host": "LocalHost", "port": 6379}, True),
        ({"host": "10.0.0.5", "port": 6379}, False),
        ({"host": "redis.internal", "port": 6379}, False),
    ],
)
@pytest.mark.parametrize("mode", ["auto", "on", "off", ""])
def test_read_ahead_by_default_only_across_a_network(monkeypatch, where: dict, here: bool, mode: str) -> None:
    monkeypatch.setenv("KVCODEC_REDIS_READ_AHEAD", mode)
    wire = Wire(where)
    assert wire.on_this_host is here
    assert wire.reads_ahead() is (mode == "on" or (mode in ("auto", "") and not here))


def test_the_read_ahead_switch_is_read_in_one_place() -> None:
    assert redis_read_ahead({}) == "auto"
    assert redis_read_ahead({"KVCODEC_REDIS_READ_AHEAD": " ON "}) == "on"
    assert redis_read_ahead({"KVCODEC_REDIS_READ_AHEAD": "sometimes"}) == "auto"


# ---------------------------------------------------------------- on a real redis-server

needs_redis = pytest.mark.skipif(redis_missing() is not None, reason=str(redis_missing()))


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator:
    if redis_missing() is not None:
        pytest.skip(str(redis_missing()))
    with redis_single(tmp_path_factory.mktemp("wire"), password="pw-wire") as srv:
        yield srv


def _read_all(url: str, keys: list[str], reads: str, fleet_key: bytes | None) -> list[bytes]:
    os.environ["KVCODEC_REDIS_READS"] = reads
    try:
        with open_store(url, StoreOptions(key_prefix="wire", fleet_key=fleet_key)) as s:
            return [bytes(p.blob) for p in s.get_parsed_many(keys, max_bytes=1 << 20)]
    finally:
        del os.environ["KVCODEC_REDIS_READS"]


@needs_redis
@pytest.mark.parametrize("fleet_key", [None, b"fleet-key-0123456789abcdef"])
@pytest.mark.parametrize("db", [0, 3])
def test_wire_and_redis_py_read_the_same_bytes(server, fleet_key: bytes | None, db: int) -> None:
    url = f"redis://:pw-wire@127.0.0.1:{server.port}/{db}"
    sizes = [300, 196_000, 197_200, 230_000, 786_400, 787_300]  # whole, and split into two parts
    keys = chunk_keys(layers=len(sizes) - 1, chunk=db)
    blobs = [make_blob(n, i) for i, n in enumerate(sizes)]
    with open_store(url, StoreOptions(key_prefix="wire", fleet_key=fleet_key)) as s:
        s.put_many(list(zip(keys, blobs)))
    with redis.Redis(host="127.0.0.1", port=server.port, password="pw-wire", db=db) as c:
        assert len(c.keys("wire~t:*")) >= 3, "some values are stored in two parts"
    wire = _read_all(url, keys, "wire", fleet_key)
    assert wire == _read_all(url, keys, "client", fleet_key) == blobs


@needs_redis
def test_a_wrong_password_is_refused_as_redis_py_refuses_it(server) -> None:
    wire = Wire.of(redis.Redis(host="127.0.0.1", port=server.port, password="not-it"))
    assert wire is not None
    with pytest.raises(redis.exceptions.AuthenticationError):
        wire.read([EXISTS])


@needs_redis
def test_a_restarted_servers_stale_sockets_are_dropped(server) -> None:
    wire = Wire.of(redis.Redis(host="127.0.0.1", port=server.port, password="pw-wire", socket_timeout=5))
    assert wire is not None and wire.read([EXISTS]) == [0]
    server.kill()
    server.start()
    assert wire.read([EXISTS]) == [0]  # the idle socket saw the server's EOF: a new one
    wire.close()


def test_tls_clients_are_left_to_redis_py() -> None:
    tls = redis.Redis(host="127.0.0.1", port=1, ssl=True)
    assert Wire.of(tls) is None
    assert Wire.of(object()) is None

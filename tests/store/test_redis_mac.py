"""The fleet MAC (kvcodec/store/auth.py) on a real redis-server: with a fleet key only key holders'
values are loaded; a planted, moved, re-keyed or truncated value is refused (BAD_MAC) and deleted."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcodec.errors import CorruptEncodedKVError, Reason, UnsupportedConfigError
from kvcodec.integrations.vllm.chunk_keys import group_of
from kvcodec.store import StoreOptions, open_store
from kvcodec.store.auth import ENVELOPE_LEN, ENVELOPE_MAGIC, load_fleet_key, open_envelope, seal
from tests.raises import raises_reason
from tests.redis_servers import chunk_keys, make_blob, redis_missing, redis_single

pytestmark = pytest.mark.skipif(redis_missing() is not None, reason=str(redis_missing()))

KEY = b"fleet-key-0123456789abcdef"
OTHER = b"another-key-0123456789abcdef"


def opts(fleet_key: bytes | None) -> StoreOptions:
    return StoreOptions(group_of=group_of, timeout_s=2.0, fleet_key=fleet_key)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with redis_single(tmp_path_factory.mktemp("redis")) as srv:
        yield srv


@pytest.fixture
def raw(server):
    with server.client() as c:
        c.flushall()
        yield c


def test_sealed_values_carry_the_envelope_and_read_back(server, raw) -> None:
    keys = chunk_keys(layers=3, chunk=0)
    blobs = [make_blob(1024, i) for i in range(len(keys))]
    with open_store(server.url, opts(KEY)) as st:
        st.put_many(list(zip(keys, blobs)))
        value = raw.get(st.name_of(keys[0]))
        assert value[: len(ENVELOPE_MAGIC)] == ENVELOPE_MAGIC and value[ENVELOPE_LEN:] == blobs[0]
        assert [bytes(p.blob) for p in st.get_parsed_many(keys)] == blobs
        assert bytes(st.get(keys[1])) == blobs[1]


@pytest.mark.parametrize(
    "forge",
    ["bare blob", "another key", "moved", "truncated mac", "flipped blob byte"],
)
def test_a_value_without_a_valid_mac_is_refused_and_deleted(server, raw, forge: str) -> None:
    keys = chunk_keys(layers=2, chunk=1)
    good = make_blob(1024, 5)
    with open_store(server.url, opts(KEY)) as st:
        st.put_many([(k, good) for k in keys])
        target = st.name_of(keys[0])
        sealed = raw.get(st.name_of(keys[1]))
        planted = {
            "bare blob": good,  # a writer without the key: well formed, valid CRC
            "another key": seal(OTHER, target, good),
            "moved": sealed,  # a valid value of another key, copied under this one
            "truncated mac": sealed[: ENVELOPE_LEN - 1],
            "flipped blob byte": sealed[:-1] + bytes([sealed[-1] ^ 1]),
        }[forge]
        raw.set(target, planted)
        errors = st.stats()["errors"]
        with raises_reason(CorruptEncodedKVError, Reason.BAD_MAC):
            st.get_parsed_many(keys)
        assert raw.exists(target) == 0 and raw.exists(st.name_of(keys[1])) == 1
        assert st.stats()["errors"] == errors + 1
        with pytest.raises(KeyError):
            st.get_parsed(keys[0])


def test_a_reader_without_the_key_reads_sealed_values_unchecked(server, raw) -> None:
    """No key: the store is trusted, as without any fleet MAC; the envelope is skipped, not an error."""
    blob = make_blob(512, 9)
    with open_store(server.url, opts(KEY)) as keyed, open_store(server.url, opts(None)) as plain:
        keyed.put("k", blob)
        assert bytes(plain.get_parsed("k").blob) == blob
        plain.put("bare", blob)
        with raises_reason(CorruptEncodedKVError, Reason.BAD_MAC):
            keyed.get("bare")


def test_prefixes_are_covered_by_the_mac(server, raw) -> None:
    blob = make_blob(512, 11)
    with open_store(server.url, StoreOptions(fleet_key=KEY, key_prefix="a")) as a:
        with open_store(server.url, StoreOptions(fleet_key=KEY, key_prefix="b")) as b:
            a.put("k", blob)
            raw.set(b.name_of("k"), raw.get(a.name_of("k")))
            with raises_reason(CorruptEncodedKVError, Reason.BAD_MAC):
                b.get("k")
            assert bytes(a.get("k")) == blob


def test_envelope_functions() -> None:
    blob = make_blob(256, 1)
    value = seal(KEY, "p:{g}:k", blob)
    assert bytes(open_envelope(KEY, "p:{g}:k", value)) == blob
    for key, name, val in ((OTHER, "p:{g}:k", value), (KEY, "p:{g}:k2", value), (KEY, "p:{g}:k", blob)):
        with raises_reason(CorruptEncodedKVError, Reason.BAD_MAC):
            open_envelope(key, name, val)
    with raises_reason(UnsupportedConfigError, Reason.BAD_VALUE):
        seal(b"short", "n", blob)


def test_load_fleet_key_from_env_or_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("KVCODEC_FLEET_KEY", raising=False)
    assert load_fleet_key() is None
    monkeypatch.setenv("KVCODEC_FLEET_KEY", KEY.decode())
    assert load_fleet_key() == KEY
    monkeypatch.setenv("MY_KEY", "")
    assert load_fleet_key("MY_KEY") is None
    f = tmp_path / "fleet.key"
    f.write_bytes(OTHER + b"\n")
    assert load_fleet_key("MY_KEY", f) == OTHER
    f.write_bytes(b"short\n")
    with raises_reason(UnsupportedConfigError, Reason.BAD_VALUE):
        load_fleet_key(None, f)
    with raises_reason(UnsupportedConfigError, Reason.BAD_VALUE):
        load_fleet_key(None, tmp_path / "absent")

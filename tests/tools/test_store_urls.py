"""``kvcodec verify`` / ``inspect`` of a store URL (``redis://...``), against a real redis-server.

The server runs on 127.0.0.1 on a free port, started and stopped by its PID
(``tests/redis_servers.py``); each test writes under its own key prefix. Skipped
where redis-server or redis-py is missing.
"""

from __future__ import annotations

import itertools
import json
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcodec.format import Header, ScaleScope, assemble, parse
from kvcodec.integrations.vllm.chunk_keys import group_of
from kvcodec.tools.cli import main
from tests.redis_servers import RedisServer, chunk_keys, free_port, redis_missing, redis_single

pytestmark = pytest.mark.skipif(redis_missing() is not None, reason=f"{redis_missing()}")

HEADS, DIM = 2, 16
_PREFIXES = itertools.count()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_single(tmp_path_factory.mktemp("redis")) as s:
        yield s


@pytest.fixture
def prefix() -> str:
    return f"kvtools{next(_PREFIXES)}"


def _blob(tokens: int = 32, seed: int = 0) -> bytearray:
    """A v2 per-tensor blob: fp16 K, e4m3fn V with finite codes, scale 0.5 (no C extension needed)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((tokens, HEADS, DIM)).astype(np.float16)
    v = rng.integers(0, 0x7F, size=tokens * HEADS * DIM, dtype=np.uint8)  # 0x00..0x7E: finite
    h = Header(
        k_dtype=torch.float16,
        v_dtype="float8_e4m3fn",
        scale_scope=ScaleScope.PER_TENSOR,
        version=2,
        chunk_size=tokens,
        kv_head_count=HEADS,
        head_dim=DIM,
    )
    return assemble(h, k.tobytes(), v.tobytes(), np.float32(0.5).tobytes())


def _put(server: RedisServer, prefix: str, blobs: dict[str, bytes]) -> None:
    """Write ``blobs`` as the connector does: its ``group_of`` names every key's hash tag."""
    from kvcodec.store import StoreOptions, open_store

    store = open_store(server.url, StoreOptions(key_prefix=prefix, group_of=group_of))
    try:
        store.put_many(list(blobs.items()))
    finally:
        store.close()


def _with_nan_code(blob: bytearray, element: int) -> bytearray:
    p = parse(blob)
    v = bytearray(p.v)
    v[element] = 0x7F
    return assemble(p.header, p.k, v, p.scales)


def test_verify_a_store_of_good_blobs(server: RedisServer, prefix: str, capsys) -> None:
    _put(server, prefix, {f"blob-{i}": _blob(seed=i) for i in range(3)})
    assert main(["verify", "--key-prefix", prefix, "-v", server.url]) == 0
    out = capsys.readouterr().out
    assert "3 ok, 0 bad" in out and out.count(": ok") == 3


def test_verify_reports_each_bad_blob_of_a_store(server: RedisServer, prefix: str, capsys) -> None:
    _put(server, prefix, {"good": _blob(), "nan-code": _with_nan_code(_blob(seed=1), (5 * HEADS + 1) * DIM)})
    assert main(["verify", "--key-prefix", prefix, server.url]) == 1
    out = capsys.readouterr().out
    assert "1 ok, 1 bad" in out
    (line,) = [ln for ln in out.splitlines() if "nan-code" in ln]
    assert "NaN" in line and "token 5, head 1" in line


def test_a_blob_the_store_refuses_is_reported(server: RedisServer, prefix: str, capsys) -> None:
    from kvcodec.store import StoreOptions, open_store

    _put(server, prefix, {"good": _blob(), "damaged": _blob(seed=2)})
    store = open_store(server.url, StoreOptions(key_prefix=prefix, group_of=group_of))
    name = store.name_of("damaged")
    store.close()
    with server.client() as c:
        value = bytearray(c.get(name))
        value[-3] ^= 0x10
        c.set(name, bytes(value))
    assert main(["verify", "--key-prefix", prefix, server.url]) == 1
    out = capsys.readouterr().out
    assert "1 ok, 1 bad" in out and "damaged" in out and "CRC" in out


def test_glob_selects_keys(server: RedisServer, prefix: str, capsys) -> None:
    _put(server, prefix, {"a-1": _blob(), "a-2": _blob(seed=1), "b-1": _with_nan_code(_blob(), 0)})
    assert main(["verify", "--key-prefix", prefix, "--glob", "a-*", server.url]) == 0
    assert "2 ok, 0 bad" in capsys.readouterr().out


def test_inspect_a_store(server: RedisServer, prefix: str, capsys) -> None:
    blobs = {f"blob-{i}": _blob(tokens=8 * (i + 1)) for i in range(3)}
    _put(server, prefix, blobs)
    assert main(["inspect", "--key-prefix", prefix, "--json", server.url]) == 0
    infos = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted(i["file"].rsplit("/", 1)[1] for i in infos) == sorted(blobs)
    assert all(i["crc_ok"] and i["v_dtype"] == "float8_e4m3fn" for i in infos)
    assert sorted(i["tokens"] for i in infos) == [8, 16, 24]
    assert main(["inspect", "--key-prefix", prefix, server.url]) == 0
    assert capsys.readouterr().out.count("== ") == 3


def test_an_unreachable_store_is_one_error_line(capsys) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    for command in ("verify", "inspect"):
        assert main([command, "--store-timeout-ms", "200", url]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error" in err and "Traceback" not in err


def test_an_empty_store_warns(server: RedisServer, prefix: str, capsys) -> None:
    assert main(["verify", "--key-prefix", prefix, server.url]) == 0
    cap = capsys.readouterr()
    assert "no blobs found" in cap.err and "verified 0 blobs" in cap.out


def test_a_store_is_walked_one_blob_at_a_time(server: RedisServer, prefix: str, capsys) -> None:
    """48 blobs of ~130 KiB (6 MiB in all): verifying them costs about one blob's decode, not the store."""
    _put(server, prefix, {f"big-{i}": _blob(tokens=2048, seed=i) for i in range(48)})
    tracemalloc.start()
    try:
        code = main(["verify", "--key-prefix", prefix, server.url])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code == 0 and "48 ok" in capsys.readouterr().out
    assert peak < 3 << 20, f"peak {peak} bytes"


def test_store_schemes_match_the_factory() -> None:
    from kvcodec.store.factory import REDIS_SCHEMES
    from kvcodec.tools.stores import STORE_SCHEMES

    assert STORE_SCHEMES == REDIS_SCHEMES


def test_paths_and_store_urls_together(server: RedisServer, prefix: str, tmp_path: Path, capsys) -> None:
    _put(server, prefix, {"one": _blob()})
    (tmp_path / "two.lmckv").write_bytes(_blob(seed=3))
    assert main(["verify", "--key-prefix", prefix, str(tmp_path / "two.lmckv"), server.url]) == 0
    assert "2 ok, 0 bad" in capsys.readouterr().out


def _flip_payload_byte(server: RedisServer, name: str) -> None:
    with server.client() as c:
        value = bytearray(c.get(name))
        value[-3] ^= 0x10
        c.set(name, bytes(value))


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_the_connectors_blobs_are_seen_and_a_damaged_one_named(
    server: RedisServer, prefix: str, command: str, capsys
) -> None:
    """Two layers' blobs of one chunk under ``<prefix>:{C0-Hh0}:<key>`` (the connector's hash tag)."""
    from kvcodec.store import StoreOptions, open_store

    good, bad = chunk_keys(layers=2, chunk=0)[:2]
    _put(server, prefix, {good: _blob(seed=1), bad: _blob(seed=2)})
    with open_store(server.url, StoreOptions(key_prefix=prefix, group_of=group_of)) as store:
        name = store.name_of(bad)
    assert "{C0-Hh0}" in name
    _flip_payload_byte(server, name)
    assert main([command, "--key-prefix", prefix, server.url]) == 1
    out = capsys.readouterr().out
    if command == "verify":
        assert "verified 2 blobs: 1 ok, 1 bad" in out
        (line,) = [ln for ln in out.splitlines() if bad in ln]
        assert "CRC" in line
    else:
        assert out.count("== ") == 2 and good in out and bad in out


def test_a_value_under_another_tag_is_still_verified(server: RedisServer, prefix: str, capsys) -> None:
    """A value whose hash tag is not what the store would write (another writer's ``group_of``) is
    read under the name it is stored under, not skipped as removed."""
    blob = _blob(seed=4)
    with server.client() as c:
        c.set(f"{prefix}:{{some-group}}:odd-key", bytes(blob))
    assert main(["verify", "--key-prefix", prefix, "-v", server.url]) == 0
    out = capsys.readouterr().out
    assert "verified 1 blobs: 1 ok, 0 bad" in out and "odd-key: ok" in out


def test_names_no_writer_of_this_store_makes_are_skipped(server: RedisServer, prefix: str, capsys) -> None:
    """A name under the prefix that is not UTF-8, or whose key is no key, is no blob of this store."""
    with server.client() as c:
        c.set(f"{prefix}:{{g}}:".encode() + b"\xff\xfe", bytes(_blob()))
        c.set(f"{prefix}:{{\xff}}:k".encode("latin-1"), bytes(_blob()))
        c.set(f"{prefix}:{{g}}:../up", bytes(_blob()))
    _put(server, prefix, {"fine": _blob(seed=5)})
    assert main(["verify", "--key-prefix", prefix, server.url]) == 0
    assert "verified 1 blobs: 1 ok, 0 bad" in capsys.readouterr().out


def test_a_key_of_another_type_is_reported_and_the_walk_goes_on(
    server: RedisServer, prefix: str, capsys
) -> None:
    from kvcodec.store import StoreOptions, open_store

    _put(server, prefix, {"a-good": _blob(), "b-list": _blob(seed=1), "c-good": _blob(seed=2)})
    with open_store(server.url, StoreOptions(key_prefix=prefix)) as store:
        name = store.name_of("b-list")
    with server.client() as c:
        c.delete(name)
        c.rpush(name, b"x")
    assert main(["verify", "--key-prefix", prefix, server.url]) == 1
    out = capsys.readouterr().out
    assert "verified 3 blobs: 2 ok, 1 bad" in out and "b-list" in out


PASSWORD = "Tr0ub4dor-and-3-horses"


@pytest.mark.parametrize("command", ["verify", "inspect"])
@pytest.mark.parametrize(
    "url",
    [
        f"redis://default:{PASSWORD}",
        f"redis+cluster://default:{PASSWORD}",
        f"rediss://default:{PASSWORD}",
        f"redis://default:{PASSWORD}/0",
        f"redis://default:{PASSWORD}@",
        f"redis-cluster://default:{PASSWORD}@127.0.0.1:1",
        f"redis://default:{PASSWORD}@127.0.0.1:{{port}}/0?bogus=1",
    ],
)
def test_no_command_prints_the_password(command: str, url: str, capsys) -> None:
    url = url.replace("{port}", str(free_port()))
    assert main([command, "--store-timeout-ms", "200", url]) in (1, 2)
    cap = capsys.readouterr()
    assert PASSWORD not in cap.out + cap.err and "Tr0ub" not in cap.out + cap.err
    assert "unexpected" not in cap.err and cap.err.count("\n") <= 1


@pytest.mark.parametrize("ms", ["100000000000000000000", "1e20", "0", "-5", "inf"])
def test_a_store_timeout_no_socket_can_take_is_a_usage_error(ms: str, capsys) -> None:
    assert main(["verify", "--store-timeout-ms", ms, "redis://127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "store-timeout-ms" in err and "unexpected" not in err

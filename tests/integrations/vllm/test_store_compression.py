"""The connector's ``compression`` key (issue 38): per store tier, lossless blobs stored and handed
back plain byte for byte (kvcodec/integrations/vllm/store_tiers.py's LosslessTier)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvcodec
from kvcodec.errors import CorruptEncodedKVError, Reason, UnsupportedConfigError
from kvcodec.format import ScaleScheme, parse
from kvcodec.integrations.vllm.buffers import ReadBuffers
from kvcodec.integrations.vllm.chunk_keys import group_of, is_manifest
from kvcodec.integrations.vllm.config import DEFAULT_COMPRESSION, KvcodecConfig
from kvcodec.integrations.vllm.store_tiers import LosslessTier, open_tiers, stores_of
from kvcodec.store import DirectoryStore, StoreOptions, open_store
from kvcodec.store.memory import MemoryStore
from tests.raises import raises_reason
from tests.redis_servers import redis_missing, redis_single
from tests.store.test_contract_memory import prompt_chunk

OPTS = StoreOptions(group_of=group_of, evict_first=is_manifest, timeout_s=0.5)


def _chunk() -> list[tuple[str, bytes]]:
    """A chunk's keys with real blobs (bf16 K, three layers) in place of the layer blobs, manifest last."""
    g = torch.Generator().manual_seed(3)
    base = prompt_chunk(0, 0)
    names = [k for k, _ in base]
    out = []
    for i, key in enumerate(names[:-1]):
        k = (torch.randn(32, 2, 16, generator=g) * (i + 1)).bfloat16()
        out.append((key, bytes(kvcodec.encode(k, k, scope="per_page_head", page_size=16, layer_id=i))))
    return [*out, base[-1]]


def test_default_is_plain_in_every_tier(tmp_path: Path) -> None:
    cfg = KvcodecConfig(root=str(tmp_path))
    assert {t: cfg.compression_of(t) for t in DEFAULT_COMPRESSION} == DEFAULT_COMPRESSION
    assert {cfg.compression_of(t) for t in ("ram", "disk", "remote")} == {"none"}
    assert isinstance(open_tiers(cfg, OPTS), DirectoryStore)  # a directory alone: plain


@pytest.mark.parametrize(
    ("given", "ram", "disk"),
    [
        ("lossless", "lossless", "lossless"),
        ("none", "none", "none"),
        ({"disk": "lossless"}, "none", "lossless"),
    ],
)
def test_the_key_takes_a_string_or_a_mapping(tmp_path: Path, given, ram, disk) -> None:
    cfg = KvcodecConfig.from_extra({"root": str(tmp_path), "compression": given})
    assert (cfg.compression_of("ram"), cfg.compression_of("disk")) == (ram, disk)
    assert KvcodecConfig(**{**cfg.__dict__}).compression == cfg.compression  # rebuilt from its fields


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("zstd", Reason.BAD_VALUE),
        ({"gpu": "none"}, Reason.BAD_VALUE),
        ({"ram": True}, Reason.BAD_VALUE),
        (3, Reason.BAD_TYPE),
    ],
)
def test_bad_values_are_refused(tmp_path: Path, bad, reason) -> None:
    with raises_reason(UnsupportedConfigError, reason):
        KvcodecConfig.from_extra({"root": str(tmp_path), "compression": bad})


def test_a_lossless_tier_stores_coded_blobs_and_gives_back_plain_ones() -> None:
    inner = MemoryStore(1 << 22, OPTS)
    st = LosslessTier(inner)
    chunk = _chunk()
    st.put_many(chunk)
    keys = [k for k, _ in chunk]
    for key, blob in chunk[:-1]:
        stored = inner.get(key)
        assert parse(stored).header.scale_scheme == ScaleScheme.LOSSLESS_SPLIT and len(stored) < len(blob)
        assert bytes(st.get(key)) == blob
        assert bytes(st.get_parsed(key, verify_crc=False).blob) == blob
    assert bytes(inner.get(keys[-1])) == chunk[-1][1] == bytes(st.get(keys[-1]))  # a manifest: as given
    assert [bytes(p.blob) for p in st.get_parsed_many(keys[:-1])] == [b for _, b in chunk[:-1]]
    assert st.contains_many(keys) == [True] * len(keys) and st.location == inner.location
    st.close()


class _Raw:
    """A store that keeps what it is given and checks nothing (a remote store's bytes, damaged on the way)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def put(self, key: str, blob: object) -> None:
        self.values[key] = bytes(blob)  # type: ignore[arg-type]

    def get(self, key: str, *, max_bytes: int | None = None) -> memoryview:
        return memoryview(self.values[key])

    def get_parsed(self, key: str, into=None, *, verify_crc: bool = True, max_bytes=None):
        return parse(self.values[key], verify_crc=verify_crc)


def test_a_damaged_coded_blob_is_refused_even_unverified() -> None:
    inner = _Raw()
    st = LosslessTier(inner)  # type: ignore[arg-type]
    key, blob = _chunk()[0]
    st.put(key, blob)
    bad = bytearray(inner.values[key])
    bad[-9] ^= 0x40
    inner.values[key] = bytes(bad)
    with raises_reason(CorruptEncodedKVError, Reason.CRC_MISMATCH):
        st.get_parsed(key, verify_crc=False)
    with raises_reason(CorruptEncodedKVError, Reason.CRC_MISMATCH):
        st.get(key)


def test_a_ram_tier_over_a_lossless_directory(tmp_path: Path) -> None:
    cfg = KvcodecConfig(root=str(tmp_path), host_cache_bytes=1 << 22, compression={"disk": "lossless"})
    st = open_tiers(cfg, OPTS)
    assert [type(t.store) for t in st.tiers][1] is LosslessTier
    assert isinstance(stores_of(st)[1], DirectoryStore)  # unwrapped for the store's own checks
    chunk = _chunk()
    st.put_many(chunk)
    key, blob = chunk[0]
    assert parse(stores_of(st)[1].get(key)).header.scale_scheme == ScaleScheme.LOSSLESS_SPLIT
    assert bytes(stores_of(st)[0].get(key)) == blob  # RAM holds the plain blob
    st.close()


class _Lending(MemoryStore):
    """A memory store whose ``get_parsed_many`` reads into one buffer lent by the caller's pool, as the
    Redis store does: the blobs view it."""

    def get_parsed_many(self, keys, *, verify_crc=True, max_bytes=None, buffers=None):  # type: ignore[override]
        got = super().get_parsed_many(keys, verify_crc=verify_crc, max_bytes=max_bytes)
        if buffers is None:
            return got
        buf = buffers.lend(sum(len(p.blob) for p in got))
        out, at = [], 0
        for p in got:
            n = len(p.blob)
            buf[at : at + n] = p.blob
            out.append(parse(memoryview(buf)[at : at + n], verify_crc=verify_crc))
            at += n
        return out


def test_expanded_blobs_go_into_the_readers_pool_and_the_stored_bytes_go_back() -> None:
    """With the reader's pool, a chunk is expanded into buffers the pool lends (given back by the reader
    and reused next time, no fresh memory per blob), the lent buffer of the stored bytes is given back
    at once, and every blob is still its plain self after the buffers were reused."""
    st = LosslessTier(_Lending(1 << 22, OPTS))
    chunk = _chunk()
    st.put_many(chunk)
    keys, want = [k for k, _ in chunk[:-1]], [b for _, b in chunk[:-1]]
    pool = ReadBuffers()
    first = st.get_parsed_many(keys, buffers=pool)
    assert [bytes(p.blob) for p in first] == want
    lent = {id(p.buffer.obj): p.buffer.obj for p in first}
    assert len(lent) == len(keys) and all(pool.owns(b) for b in lent.values())
    assert pool.idle_bytes > 0  # the stored bytes' buffer, back already
    pool.give(list(lent.values()))
    again = st.get_parsed_many(keys[::-1], buffers=pool)
    assert [bytes(p.blob) for p in again] == want[::-1]
    reused = sum(id(p.buffer.obj) in lent for p in again)
    assert reused >= len(keys) - 1  # at most one taken by the stored bytes' read
    st.close()


def test_get_parsed_expands_into_the_callers_buffer(tmp_path: Path) -> None:
    """``into`` large enough holds the expanded blob (the reader gives it back and lends it again); too
    small, a new buffer; a blob stored plain read through the tier's own buffer comes back as a copy
    that a later read does not overwrite."""
    st = LosslessTier(DirectoryStore(tmp_path, fsync=False, group_of=group_of))
    chunk = _chunk()
    st.put_many(chunk)
    (k0, b0), (k1, b1) = chunk[0], chunk[1]
    into = bytearray(2 * len(b0))
    p = st.get_parsed(k0, into, verify_crc=False)
    assert bytes(p.blob) == b0 and p.buffer.obj is into
    small = st.get_parsed(k1, bytearray(8))
    assert bytes(small.blob) == b1 and len(small.buffer.obj) >= len(b1)
    manifest = st.get_parsed(chunk[-1][0])
    st.get_parsed(k1)
    assert bytes(manifest.blob) == chunk[-1][1]
    assert bytes(st.get_parsed(k0, into).blob) == b0  # into reused: rewritten whole
    st.close()


def test_a_lossless_redis_tier_reads_and_expands_into_the_pool(tmp_path: Path) -> None:
    """On a real redis-server: the stored bytes are read into one buffer the pool lends (given back at
    once), each blob expanded into its own lent buffer, plain byte for byte, twice over reused buffers."""
    if redis_missing() is not None:
        pytest.skip(str(redis_missing()))
    with (
        redis_single(tmp_path) as srv,
        open_store(srv.url, StoreOptions(key_prefix="ll", group_of=group_of)) as rs,
    ):
        st = LosslessTier(rs)
        chunk = _chunk()
        st.put_many(chunk)
        keys, want = [k for k, _ in chunk[:-1]], [b for _, b in chunk[:-1]]
        pool = ReadBuffers()
        for _ in range(2):
            got = st.get_parsed_many(keys, verify_crc=False, buffers=pool)
            assert [bytes(p.blob) for p in got] == want
            assert all(pool.owns(p.buffer.obj) for p in got) and pool.idle_bytes > 0
            pool.give([p.buffer.obj for p in got])

"""The connector's CPU load reads blobs without their CRC and checks it in the C pass that writes them.

A blob damaged at rest (a K byte, a V code or a scale byte flipped, its CRC left as it was) passes
every check of the read and is found while written: the chunk is reported as a load error (vLLM
recomputes its blocks), its manifest and blobs are removed, and the chunks before it load as usual.
(On by default, ``loads.DEFER_CRC``; set here so that each test says which it tests.) No engine: the hooks are called as vLLM's model runner calls them (``tests/.../workers.py``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base", reason="needs vLLM")

from kvcodec.format import parse
from kvcodec.integrations.vllm.connector import KvcodecConnector, KvcodecMetadata, LoadSpec, SaveSpec
from kvcodec.integrations.vllm.worker import ConnectorParts
from tests.integrations.vllm.workers import BLOCK, BLOCK_IDS, CHUNK, HASHES, HookedStore, cpu_worker

LOAD_BLOCKS = [7, 6, 5, 2]
"""Where the hit is loaded: blocks other than the ones it was saved from."""


def _saved(root: Path) -> KvcodecConnector:
    """A worker with both chunks stored, its loads deferring the CRC to the write."""
    conn = cpu_worker(root)
    loads = conn.worker.loads  # type: ignore[union-attr]
    assert loads.can_defer_crc
    loads.defer_crc = True
    saves = [SaveSpec("w", c, HASHES[c], HASHES[c - 1] if c else None, BLOCK_IDS) for c in range(2)]
    conn.bind_connector_metadata(KvcodecMetadata(saves=saves))
    conn.wait_for_save()
    conn.clear_connector_metadata()
    assert conn.drain(60)
    return conn


def _keys(conn: KvcodecConnector, c: int) -> list[str]:
    loads = conn.worker.loads  # type: ignore[union-attr]
    spec = LoadSpec("r", 0, 2 * CHUNK, HASHES, LOAD_BLOCKS)
    return [*loads._blob_keys(spec, c).values(), loads.keys.manifest(spec.ref(c))]


def _damage(path: Path, part: str) -> None:
    """One payload byte of the blob file changed, its CRC left as it was."""
    data = bytearray(path.read_bytes())
    p = parse(bytes(data), verify_crc=False, remember=False)
    h = p.header
    at = {"k": 0, "v": h.k_payload_len, "scale": h.k_payload_len + h.v_payload_len}[part]
    at += p.header_len + (7 if part == "v" else 0)
    data[at] ^= 0x02 if part == "v" else 0x01  # a V code stays a number; a scale stays valid
    path.write_bytes(bytes(data))


def _load(conn: KvcodecConnector) -> set[int]:
    conn.bind_connector_metadata(KvcodecMetadata(loads=[LoadSpec("r", 0, 2 * CHUNK, HASHES, LOAD_BLOCKS)]))
    conn.start_load_kv(None)  # type: ignore[arg-type]  # a synchronous load: read, check, write here
    conn.clear_connector_metadata()
    return conn.get_block_ids_with_load_errors()


def test_a_clean_hit_loads_the_same_bytes_as_with_the_crc_checked_first(tmp_path: Path) -> None:
    deferred = _saved(tmp_path)
    first = cpu_worker(tmp_path)  # the same caches, the same store
    assert first.worker.loads.defer_crc  # type: ignore[union-attr]  # the default: DEFER_CRC
    first.worker.loads.defer_crc = False  # type: ignore[union-attr]  # the CRC checked in the read
    before = {n: c.clone() for n, c in first.worker.caches.caches.items()}  # type: ignore[union-attr]
    assert _load(deferred) == set() and _load(first) == set()
    assert deferred.stats["chunks_loaded"] == first.stats["chunks_loaded"] == 2
    for n, c in deferred.worker.caches.caches.items():  # type: ignore[union-attr]
        other = first.worker.caches.caches[n]  # type: ignore[union-attr]
        assert torch.equal(c.view(torch.int16), other.view(torch.int16))
        assert not torch.equal(other.view(torch.int16), before[n].view(torch.int16))  # written
    deferred.shutdown()
    first.shutdown()


@pytest.mark.parametrize("part", ["k", "v", "scale"])
def test_a_damaged_blob_fails_its_chunk_and_is_removed(
    tmp_path: Path, part: str, caplog: pytest.LogCaptureFixture
) -> None:
    conn = _saved(tmp_path)
    store = conn.worker.loads.store  # type: ignore[union-attr]
    bad = _keys(conn, 1)
    _damage(tmp_path / bad[1], part)  # layer 1 of chunk 1
    with caplog.at_level(logging.WARNING, logger="vllm.kvcodec"):
        errors = _load(conn)
    assert errors == set(LOAD_BLOCKS[CHUNK // BLOCK :])  # chunk 1's blocks: recomputed
    assert "CorruptEncodedKVError" in caplog.text and "CRC mismatch" in caplog.text
    assert "not written" in caplog.text  # found by the write's C pass, not by the read
    assert not any(store.contains(k) for k in bad)  # its blobs and manifest are gone
    assert all(store.contains(k) for k in _keys(conn, 0))
    assert conn.stats["chunks_loaded"] == 1
    conn.shutdown()


class _KeywordsSeen(HookedStore):
    """A store of the Protocol's shape that records the keywords its reads are given."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.seen: list[dict[str, object]] = []

    def get_parsed(self, key: str, into: bytearray | None = None, **kw: object) -> object:
        self.seen.append(kw)
        return super().get_parsed(key, into, **kw)


def test_a_store_of_the_protocols_shape_gets_verify_crc_and_max_bytes(tmp_path: Path) -> None:
    """The load passes the keywords the BlobStore Protocol declares, to any store (none is probed)."""
    _saved(tmp_path).shutdown()
    store = _KeywordsSeen(tmp_path)
    conn = cpu_worker(tmp_path, ConnectorParts(store=store))
    assert conn.worker.loads.defer_crc  # type: ignore[union-attr]  # the default, for this store too
    assert _load(conn) == set() and conn.stats["chunks_loaded"] == 2
    assert store.seen and all(kw["verify_crc"] is False and kw["max_bytes"] > 0 for kw in store.seen)  # type: ignore[operator]
    conn.shutdown()

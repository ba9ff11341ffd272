"""The BlobStore contract (tests/store/contract.py) for MemoryStore and for a TieredStore of a
MemoryStore in front of a DirectoryStore; then what only a RAM tier does (a bound in bytes)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcodec.errors import Reason, UnsupportedConfigError
from kvcodec.integrations.vllm.chunk_keys import ChunkRef, group_of, is_manifest
from kvcodec.store import BlobStore, DirectoryStore, StoreFullError, StoreOptions
from kvcodec.store.memory import MemoryStore
from kvcodec.store.tiers import Tier, TieredStore
from tests.raises import raises_reason
from tests.redis_servers import connector_keys
from tests.store.contract import BlobStoreContract, blob

RAM = 1 << 20


def _plant_memory(store: MemoryStore, key: str, data: bytes) -> None:
    """What a bit flip in RAM leaves: the stored bytes changed behind the store's back."""
    store._blobs[key] = data
    store._index.record(key, store._index.next_stamp(), len(data))


class TestMemoryStore(BlobStoreContract):
    @pytest.fixture
    def store_factory(self) -> Iterator[Callable[..., BlobStore]]:
        opened: list[BlobStore] = []

        def make(options: StoreOptions | None = None) -> BlobStore:
            st = MemoryStore(RAM, options)
            opened.append(st)
            return st

        yield make
        for st in opened:
            st.close()

    @pytest.fixture
    def plant(self) -> Callable[[BlobStore, str, bytes], None]:
        return _plant_memory  # type: ignore[return-value]


class TestTieredStore(BlobStoreContract):
    @pytest.fixture
    def store_factory(self, tmp_path: Path) -> Iterator[Callable[..., BlobStore]]:
        opened: list[BlobStore] = []

        def make(options: StoreOptions | None = None) -> BlobStore:
            opts = options or StoreOptions()
            disk = DirectoryStore.from_options(str(tmp_path / f"disk{len(opened)}"), opts)
            st = TieredStore([Tier("ram", MemoryStore(RAM, opts)), Tier("disk", disk)], opts)
            opened.append(st)
            return st

        yield make
        for st in opened:
            st.close()

    @pytest.fixture
    def plant(self) -> Callable[[BlobStore, str, bytes], None]:
        def write(store: BlobStore, key: str, data: bytes) -> None:
            """Damaged in every tier (damage in one tier with a good copy below is served: test_tiers.py)."""
            assert isinstance(store, TieredStore)
            ram, disk = (t.store for t in store.tiers)
            _plant_memory(ram, key, data)  # type: ignore[arg-type]
            (Path(disk.root) / key).write_bytes(data)  # type: ignore[attr-defined]

        return write


def prompt_chunk(prompt: int, chunk: int, layers: int = 3, nbytes: int = 4096) -> list[tuple[str, bytes]]:
    """Chunk ``chunk`` of prompt ``prompt``: its layers' blobs and its manifest (last), as the connector
    names and writes them."""
    keys: Any = connector_keys("0123456789abcdef")
    ref = ChunkRef(chunk, f"p{prompt}c{chunk}", f"p{prompt}c{chunk - 1}" if chunk else None)
    names = [keys.blob(0, layer, ref) for layer in range(layers)] + [keys.manifest(ref)]
    return [(k, blob(1000 * prompt + 10 * chunk + i, nbytes)) for i, k in enumerate(names)]


def test_memory_store_holds_at_most_max_bytes_and_evicts_whole_chunks() -> None:
    one = sum(len(b) for _, b in prompt_chunk(0, 0))
    st = MemoryStore(5 * one, StoreOptions(group_of=group_of, evict_first=is_manifest))
    for p in range(10):  # a stream of 2-chunk prompts
        for c in range(2):
            st.put_many(prompt_chunk(p, c))
            assert st.total_bytes <= st.max_bytes
    held = {group_of(k)[0] for k in st.keys()}
    for g in held:  # every chunk held is whole: its blobs and its manifest
        members = [k for k in st.keys() if group_of(k)[0] == g]
        assert len(members) == 4, members
    assert len(held) >= 2


def test_memory_store_refuses_a_blob_larger_than_its_bound() -> None:
    st = MemoryStore(1000)
    with raises_reason(StoreFullError, Reason.STORE_FULL):
        st.put("big", blob(1, 4096))
    for bad in (None, 0, -5, 1.5):
        with pytest.raises(UnsupportedConfigError):
            MemoryStore(bad)  # type: ignore[arg-type]

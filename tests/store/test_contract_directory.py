"""The BlobStore contract (tests/store/contract.py) for DirectoryStore, opened through open_store."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvcodec.store import BlobStore, DirectoryStore, StoreOptions, open_store
from tests.store.contract import BlobStoreContract


class TestDirectoryStore(BlobStoreContract):
    @pytest.fixture
    def store_factory(self, tmp_path: Path) -> Iterator[Callable[..., BlobStore]]:
        opened: list[BlobStore] = []

        def make(options: StoreOptions | None = None) -> BlobStore:
            st = open_store(tmp_path / f"store{len(opened)}", options)
            opened.append(st)
            return st

        yield make
        for st in opened:
            st.close()

    @pytest.fixture
    def plant(self) -> Callable[[BlobStore, str, bytes], None]:
        def write(store: BlobStore, key: str, data: bytes) -> None:
            assert isinstance(store, DirectoryStore)
            (Path(store.root) / key).write_bytes(data)

        return write

    def test_partial_groups_is_false(self, store: BlobStore) -> None:
        assert store.partial_groups is False  # eviction removes whole groups

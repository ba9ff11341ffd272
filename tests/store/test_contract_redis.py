"""The BlobStore contract (tests/store/contract.py) for RedisStore: a real redis-server on 127.0.0.1,
and a real 3-node Redis Cluster, each opened through open_store; every store gets its own key prefix."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator

import pytest

from kvcodec.integrations.vllm.chunk_keys import group_of
from kvcodec.store import BlobStore, StoreOptions, open_store
from tests.redis_servers import redis_cluster, redis_missing, redis_single
from tests.store.contract import BlobStoreContract

pytestmark = pytest.mark.skipif(redis_missing() is not None, reason=str(redis_missing()))

_PREFIXES = itertools.count()


def _factory(url: str) -> Iterator[Callable[..., BlobStore]]:
    """Stores on ``url``, each under a prefix of its own (so each starts empty), with the connector's
    groups and a timeout generous for a busy test machine unless the test gives one."""
    opened: list[BlobStore] = []

    def make(options: StoreOptions | None = None) -> BlobStore:
        opts = options or StoreOptions(group_of=group_of, timeout_s=2.0)
        st = open_store(url, dataclasses.replace(opts, key_prefix=f"contract{next(_PREFIXES)}"))
        opened.append(st)
        return st

    yield make
    for st in opened:
        st.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with redis_single(tmp_path_factory.mktemp("redis")) as srv:
        yield srv


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with redis_cluster(tmp_path_factory.mktemp("cluster")) as cl:
        yield cl


class TestRedisStore(BlobStoreContract):
    @pytest.fixture
    def store_factory(self, server) -> Iterator[Callable[..., BlobStore]]:
        yield from _factory(server.url)

    @pytest.fixture
    def plant(self, server) -> Callable[[BlobStore, str, bytes], None]:
        def write(store: BlobStore, key: str, data: bytes) -> None:
            with server.client() as c:
                c.set(store.name_of(key), data)  # type: ignore[attr-defined]

        return write

    def test_partial_groups_is_true(self, store: BlobStore) -> None:
        assert store.partial_groups is True  # Redis evicts single values


class TestRedisClusterStore(BlobStoreContract):
    @pytest.fixture
    def store_factory(self, cluster) -> Iterator[Callable[..., BlobStore]]:
        yield from _factory(cluster.url)

    @pytest.fixture
    def plant(self, cluster) -> Callable[[BlobStore, str, bytes], None]:
        def write(store: BlobStore, key: str, data: bytes) -> None:
            name = store.name_of(key)  # type: ignore[attr-defined]
            with cluster.node_of(name).client() as c:
                c.set(name, data)

        return write

"""RedisStore: the blob store of a fleet of engines sharing one Redis server or Redis Cluster.

Opened by :func:`kvcodec.store.open_store` for ``redis://``, ``rediss://`` (TLS),
``redis+cluster://h1:p1,h2:p2`` and ``rediss+cluster://`` URLs, on redis-py
(``redis.Redis`` for one server, ``redis.cluster.RedisCluster`` for a cluster; a
plain ``redis://`` URL that reaches a cluster node is detected by ``INFO cluster``).

* **Names.** A key is stored as ``<key_prefix>:{<group id>}:<key>`` with the
  group id from ``StoreOptions.group_of``: every blob of a chunk and its manifest
  share one hash tag, so on a cluster they live in one slot (one node) and a
  chunk is written and read in one pipeline.
* **Round trips.** ``get_parsed_many``, ``contains_many`` and ``put_many`` are
  one pipeline each (on a cluster, one per slot they touch; ``stats`` counts
  that). Values are read whole; ``get_parsed``'s ``into`` is not used.
* **Verified reads.** A value is checked (the fleet MAC first when a fleet key
  is set; then the sizes its header declares against its length,
  ``TRUNCATED_PAYLOAD`` / ``SIZE_MISMATCH``; then :func:`kvcodec.format.parse`
  with its CRC) and a value that fails is deleted before its
  :class:`CorruptEncodedKVError` is raised with that check's reason.
* **Timeouts and outages.** Every call waits at most ``StoreOptions.timeout_s``
  (default 50 ms) per socket operation (connect, send, each read), with no
  retries: a call on a dead server or node raises
  :class:`~kvcodec.errors.StoreUnavailableError` (``STORE_UNAVAILABLE``, or
  ``STORE_TIMEOUT`` when it ran past its timeout). While the server (or node) is
  down after a timeout, its calls fail at once without I/O, but for one probe per
  ``PROBE_INTERVAL_S`` (1 s) whose answer ends the outage (a refused connection
  costs no wait: the next call asks again). The first failure of an
  outage logs one WARNING, the first success after it one INFO; connections are
  re-made on the next call, so a restarted server serves the same store object.
  Refused credentials or ACL permissions are no outage: they raise
  :class:`~kvcodec.errors.UnsupportedConfigError` (``STORE_AUTH``), logged at ERROR
  at most once a minute.
* **Eviction** is Redis's own (``maxmemory-policy``): one blob of a chunk can go
  alone, so ``partial_groups`` is True. ``max_bytes`` and ``fsync`` are ignored;
  a server that refuses writes for memory (``noeviction``) raises
  :class:`~kvcodec.store.StoreFullError`.
* **Credentials** come from the URL (``redis://user:password@host:port/db``) or
  from ``KVCODEC_REDIS_USERNAME`` / ``KVCODEC_REDIS_PASSWORD`` (percent-encoded in the URL); ``location``,
  ``repr`` and log lines show ``host:port/db`` only. ``rediss://`` checks the
  server's certificate against the system's CAs, or the bundle named by
  ``?ca_certs=PATH`` / ``KVCODEC_REDIS_CA_CERTS``.

redis-py is imported only when this module is (``import kvcodec`` never is).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any, NoReturn, TypeVar

import redis
import redis.cluster
from redis.crc import key_slot

from ..errors import CorruptEncodedKVError, Reason, StoreUnavailableError, UnsupportedConfigError
from ..format import ParsedBlob, as_bytes_view, parse
from . import redis_outage
from .auth import open_envelope, seal, strip_envelope
from .base import StoreFullError, StoreOptions
from .counters import Counters
from .keys import validate_key
from .reading import check_size
from .redis_outage import Outages
from .redis_url import CA_CERTS_ENV, PASSWORD_ENV, USERNAME_ENV, RedisURL, auth_refusal, connect

__all__ = [
    "AUTH_LOG_INTERVAL_S",
    "CA_CERTS_ENV",
    "DEFAULT_KEY_PREFIX",
    "PASSWORD_ENV",
    "USERNAME_ENV",
    "RedisStore",
    "RedisURL",
]

log = logging.getLogger(__name__)

DEFAULT_KEY_PREFIX = "kvcodec"
"""The namespace of a store opened without ``key_prefix`` (the connector's keys carry the model identity)."""
AUTH_LOG_INTERVAL_S = 60.0
"""At most one ERROR line per this many seconds for refused credentials or permissions."""

_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:-]{1,100}")
_GROUP_SAFE = re.compile(r"[^{}]+")
_SCAN_COUNT = 1000
_NODE_IN_ERROR = re.compile(r"(?:connecting to|reading from|writing to) \[?([\w.:-]+?)\]?:(\d+)")
"""A node in redis-py's error text ("Error 111 connecting to 10.0.0.5:7001."), when it names one."""
_T = TypeVar("_T")


def _nodes(client: Any) -> list[Any]:
    """One plain client per server to SCAN: the client itself, or each primary of a cluster."""
    if isinstance(client, redis.cluster.RedisCluster):
        return [client.get_redis_connection(n) for n in client.get_primaries()]
    return [client]


class RedisStore:
    """Key -> LMCKV blob store on a Redis server or Redis Cluster (see the module docstring).

    Safe to share between threads (redis-py pools its connections); starts no
    threads. Open one with :meth:`from_url` or :func:`kvcodec.store.open_store`.
    """

    partial_groups = True

    def __init__(self, url: RedisURL, options: StoreOptions | None = None) -> None:
        opts = options if options is not None else StoreOptions()
        if not isinstance(opts.timeout_s, (int, float)) or not opts.timeout_s > 0:
            raise UnsupportedConfigError(
                f"timeout_s must be a positive number, got {opts.timeout_s!r}", reason=Reason.BAD_VALUE
            )
        prefix = opts.key_prefix if opts.key_prefix is not None else DEFAULT_KEY_PREFIX
        if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
            raise UnsupportedConfigError(
                f"key_prefix {prefix!r} must be 1..100 characters of [A-Za-z0-9_.:-]", reason=Reason.BAD_VALUE
            )
        self._url = url
        self._opts = opts
        self._prefix = prefix
        self._group_of: Callable[[str], tuple[str, int, str | None]] | None = opts.group_of
        self._lock = threading.Lock()
        self._client: Any = None
        self._cluster = bool(url.cluster)
        self._down = Outages()
        """What is out: the server (its location), or on a cluster each node (``host:port``) that failed."""
        self._auth_logged = -AUTH_LOG_INTERVAL_S - 1.0
        self._closed = False
        self._counts = Counters()
        self.location = url.location

    @classmethod
    def from_url(cls, url: str, options: StoreOptions | None = None) -> RedisStore:
        """A store on the server or cluster ``url`` names; it connects on first use (a server that
        is down now is an outage: calls raise StoreUnavailableError until it is up)."""
        if not isinstance(url, str):
            raise UnsupportedConfigError(
                f"store URL must be a str, got {type(url).__name__}", reason=Reason.BAD_TYPE
            )
        return cls(RedisURL.parse(url), options)

    # ------------------------------------------------------------ names

    @property
    def key_prefix(self) -> str:
        """The namespace every name of this store starts with."""
        return self._prefix

    @property
    def cluster(self) -> bool:
        """Whether the store talks to a Redis Cluster (known once it has connected)."""
        return self._cluster

    def name_of(self, key: str) -> str:
        """The Redis name of ``key``: ``<prefix>:{<group id>}:<key>`` (the group is the hash tag)."""
        validate_key(key)
        group = self._group_of(key)[0] if self._group_of is not None else key
        if not isinstance(group, str) or not _GROUP_SAFE.fullmatch(group):
            group = key  # a group id that cannot be a hash tag: the key is its own group
        return f"{self._prefix}:{{{group}}}:{key}"

    def _key_of(self, name: bytes | str) -> str | None:
        """The key a Redis name stores, None for a name this store did not write."""
        text = name.decode(errors="replace") if isinstance(name, bytes) else name
        head = f"{self._prefix}:{{"
        if not text.startswith(head):
            return None
        _, sep, key = text[len(head) :].partition("}:")
        if not sep:
            return None
        try:
            return validate_key(key)
        except UnsupportedConfigError:
            return None

    # ------------------------------------------------------------ writes

    def _value(self, name: str, blob: Any) -> Any:
        mv = as_bytes_view(blob)
        return seal(self._opts.fleet_key, name, mv) if self._opts.fleet_key else mv

    def put(self, key: str, blob: Any) -> None:
        """Store ``blob`` under ``key`` (one ``SET``: atomic; sealed with the fleet MAC when keyed)."""
        self.put_many([(key, blob)])

    def put_many(self, items: Sequence[tuple[str, Any]]) -> None:
        """``put`` each item in order, in one pipeline (per slot on a cluster); each ``SET`` atomic."""
        staged = [(self.name_of(k), b) for k, b in items]
        if not staged:
            return
        values = [(n, self._value(n, b)) for n, b in staged]

        def run(client: Any) -> None:
            pipe = client.pipeline(transaction=False)
            for name, value in values:
                pipe.set(name, value)
            pipe.execute()

        self._call(run, [n for n, _ in values])
        self._count(bytes_written=sum(len(v) for _, v in values))

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if a value was removed."""
        name = self.name_of(key)
        return bool(self._call(lambda c: c.delete(name), [name]))

    # ------------------------------------------------------------ reads

    def contains(self, key: str) -> bool:
        """Whether a value is stored under ``key`` (not verified)."""
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """``contains`` of each key, in one pipeline of ``EXISTS`` (per slot on a cluster)."""
        names = [self.name_of(k) for k in keys]
        if not names:
            return []

        def run(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return pipe.execute()

        return [bool(x) for x in self._call(run, names)]

    def _fetch(self, keys: Sequence[str]) -> list[tuple[str, str, bytes | None]]:
        """``(key, name, value or None)`` of each key, in one pipeline of ``GET``."""
        names = [self.name_of(k) for k in keys]

        def run(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            return pipe.execute()

        values = self._call(run, names) if names else []
        got = [v for v in values if v is not None]
        self._count(hits=len(got), misses=len(values) - len(got), bytes_read=sum(len(v) for v in got))
        return list(zip(keys, names, values))

    def _verified(self, key: str, name: str, value: bytes, verify_crc: bool = True) -> ParsedBlob:
        """The parsed blob of one value; a value that fails a check is deleted, then refused."""
        try:
            blob = (
                open_envelope(self._opts.fleet_key, name, value)
                if self._opts.fleet_key
                else strip_envelope(value)
            )
            check_size(blob, len(blob))  # the header's sizes against the value's, before the CRC
            return parse(blob, verify_crc=verify_crc)
        except CorruptEncodedKVError as e:
            self._count(errors=1)
            try:
                self._call(lambda c: c.delete(name), [name])
                where = "deleted"
            except StoreUnavailableError:
                where = "could not be deleted (store unavailable)"
            raise CorruptEncodedKVError(
                f"stored blob {key!r} in {self.location} is refused: {e}; {where}", reason=e.reason
            ) from None

    def get(self, key: str) -> memoryview:
        """The verified blob under ``key`` (CRC checked unless ``verify_blobs=False``); KeyError on a miss."""
        ((_, name, value),) = self._fetch([key])
        if value is None:
            raise KeyError(key)
        return self._verified(key, name, value, self._opts.verify_blobs).blob

    def get_parsed(self, key: str, into: bytearray | None = None, *, verify_crc: bool = True) -> ParsedBlob:
        """The blob under ``key``, read in one ``GET`` and parsed once with its CRC (``into`` unused:
        the client hands over the value as bytes already; ``verify_crc`` ignored: always checked)."""
        return self.get_parsed_many([key])[0]

    def get_parsed_many(self, keys: Sequence[str], *, verify_crc: bool = True) -> list[ParsedBlob]:
        """Each key's parsed blob from one pipeline, all or nothing: ``KeyError`` names the first
        missing key; a damaged value is deleted and raises with its check's reason (``verify_crc``
        ignored: the CRC is always checked)."""
        fetched = self._fetch(keys)
        for key, _, value in fetched:
            if value is None:
                raise KeyError(key)
        return [self._verified(k, n, v) for k, n, v in fetched]  # type: ignore[arg-type]

    def iter_keys(self) -> Iterator[str]:
        """Every key of this store's prefix, by ``SCAN`` (node after node on a cluster): bounded memory;
        a key written or removed during the scan may or may not be listed."""
        match = f"{self._prefix}:{{*"  # the prefix has no glob characters
        for node in self._call(_nodes, trips=0):
            cursor = None
            while cursor != 0:
                cursor, names = self._call(
                    lambda c, node=node, at=cursor or 0: node.scan(at, match=match, count=_SCAN_COUNT)
                )
                for name in names:
                    key = self._key_of(name)
                    if key is not None:
                        yield key

    def keys(self) -> list[str]:
        """Every key of this store's prefix, sorted (one SCAN pass)."""
        return sorted(self.iter_keys())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.contains(key)

    def used_memory(self) -> int:
        """The servers' ``used_memory`` summed (bytes; every primary of a cluster): what the store costs."""

        def run(client: Any) -> list[dict[str, Any]]:
            if isinstance(client, redis.cluster.RedisCluster):
                return list(client.info("memory", target_nodes=client.PRIMARIES).values())
            return [client.info("memory")]

        return sum(int(node["used_memory"]) for node in self._call(run))

    # ------------------------------------------------------------ plumbing

    def stats(self) -> dict[str, float]:
        """Cumulative counters (:data:`~kvcodec.store.STORE_COUNTERS`): ``round_trips`` counts pipelines
        (one per slot on a cluster), ``hits``/``misses`` keys found or not by the reads that return
        blobs (``get``, ``get_parsed``, ``get_parsed_many``; not ``contains``), ``errors`` failed calls
        that did not time out (also those refused at once during an outage) plus refused values."""
        return self._counts.snapshot()

    def _count(self, **deltas: float) -> None:
        self._counts.add(**deltas)

    def _connected(self) -> Any:
        if self._closed:
            raise UnsupportedConfigError(f"store at {self.location} is closed", reason=Reason.BAD_VALUE)
        client = self._client
        if client is None:
            client, cluster = connect(self._url, float(self._opts.timeout_s))
            with self._lock:
                if self._client is None:
                    self._client, self._cluster = client, cluster
                    old, self.location = self.location, replace(self._url, cluster=cluster or None).location
                    self._down.rename(old, self.location)  # an outage under its former name
                else:  # another thread connected first
                    client.close()
                client = self._client
        return client

    def _call(self, fn: Callable[[Any], _T], names: Sequence[str] = (), trips: int | None = None) -> _T:
        """``fn(client)`` on the values ``names`` (one round trip, or one per slot on a cluster, unless
        ``trips`` says), with redis-py's failures turned into StoreUnavailableError / StoreFullError and
        each outage logged once."""
        trips = self._trips(names) if trips is None else trips
        if self._down and (trips or self._client is None):  # listing known nodes is no probe
            self._fail_fast(names)
        try:
            client = self._connected()
            out = fn(client)
        except redis.exceptions.TimeoutError as e:
            self._failed(Reason.STORE_TIMEOUT, e, names)
        except redis.exceptions.OutOfMemoryError as e:
            self._count(errors=1)
            raise StoreFullError(f"{self.location} refused a write: {e}") from None
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
            self._refused(e)
            self._failed(Reason.STORE_UNAVAILABLE, e, names)
        self._count(round_trips=trips)
        if self._down and trips:  # only an answer from a server ends an outage
            self._mend(client, names)
        return out

    def _trips(self, names: Sequence[str]) -> int:
        """Round trips of one pipeline over ``names``: one, or one per slot on a cluster."""
        if not self._cluster or len(names) < 2:
            return 1
        return len({key_slot(n.encode()) for n in names})

    def _target(self, e: BaseException, names: Sequence[str]) -> str:
        """What failed: on a cluster the node (``host:port``) redis-py names, or the one node that
        serves ``names``, or the node the error's text names; else the store as a whole."""
        if not self._cluster:
            return self.location
        conn = getattr(e, "connection", None)
        host, port = getattr(conn, "host", None), getattr(conn, "port", None)
        if host and port:
            return f"{host}:{port}"
        nodes = self._nodes_of(names)
        if len(nodes) == 1:
            return nodes.pop()
        m = _NODE_IN_ERROR.search(str(e))
        return f"{m.group(1)}:{m.group(2)}" if m else self.location

    def _nodes_of(self, names: Sequence[str]) -> set[str]:
        """The nodes (``host:port``) that serve ``names`` by the cluster client's slot map."""
        client, nodes = self._client, set()
        if isinstance(client, redis.cluster.RedisCluster):
            for name in names:
                try:
                    node = client.get_node_from_key(name)
                except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException):
                    continue
                nodes.add(f"{node.host}:{node.port}")
        return nodes

    def _fail_fast(self, names: Sequence[str]) -> None:
        """Raise at once, without I/O, when a target of this call is down and not due for a probe."""
        targets = {self.location} | (self._nodes_of(names) if self._cluster else set())
        target = self._down.blocked(targets)
        if target is not None:
            self._count(errors=1)
            where = "" if target == self.location else f" (node {target})"
            raise StoreUnavailableError(
                f"store {self.location}{where} is down; it is probed again within {redis_outage.PROBE_INTERVAL_S} s",
                reason=Reason.STORE_UNAVAILABLE,
            )

    def _refused(self, e: BaseException) -> None:
        """Raise the configuration error a refused login or command is (ERROR logged, rate-limited)."""
        refusal = auth_refusal(e, self.location)
        if refusal is None:
            return
        self._count(errors=1)
        now = time.monotonic()
        if now - self._auth_logged >= AUTH_LOG_INTERVAL_S:
            self._auth_logged = now
            log.error("kvcodec %s (%s): calls fail until the store's user or password is fixed", refusal, e)
        raise refusal from None

    def _failed(self, reason: Reason, e: BaseException, names: Sequence[str]) -> NoReturn:
        self._count(**{"timeouts" if reason is Reason.STORE_TIMEOUT else "errors": 1})
        target = self._target(e, names)
        first = self._down.failed(target, costly=reason is Reason.STORE_TIMEOUT)
        what = f"{type(e).__name__}: {e}"
        if first:
            where = "" if target == self.location else f" (node {target})"
            log.warning(
                "kvcodec store %s%s is unavailable (%s): lookups miss and saves are dropped until it is back",
                self.location,
                where,
                what,
            )
        raise StoreUnavailableError(f"store {self.location}: {what}", reason=reason) from None

    def _mend(self, client: Any, names: Sequence[str]) -> None:
        """End the outages an answer disproves: the store's; on a cluster also those of the nodes
        that served ``names``."""
        back: set[str] | None = None  # one server: any answer is all of it
        if isinstance(client, redis.cluster.RedisCluster):
            back = {self.location} | self._nodes_of(names)
        for target in self._down.mend(back):
            where = "" if target == self.location else f" (node {target})"
            log.info("kvcodec store %s%s is reachable again", self.location, where)

    def close(self) -> None:
        """Drop the connections (no network wait); later calls raise."""
        self._closed = True
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except (redis.exceptions.RedisError, OSError):  # pragma: no cover - a socket already gone
                pass

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RedisStore({self.location!r}, key_prefix={self._prefix!r}, mac={bool(self._opts.fleet_key)})"

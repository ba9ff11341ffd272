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
  one pipeline each (on a cluster, one per node, each counted per slot it
  touches in ``stats``; see :mod:`.redis_calls`). ``get_parsed``'s ``into`` is not used.
* **Values sized to the allocator** (:mod:`.redis_values`): a value more than a small key's cost
  over its jemalloc size class is stored as a head of exactly one class and a tail (``<name>~t``,
  the same slot), both in one ``MSET`` (atomic; every write is an ``MSET``), read in the same
  pipeline as the head: Redis then keeps about 0.75x of the raw KV, not 0.875x.
* **Bounded reads.** A read never holds more of a value than the blob its caller
  expects: each value is read with ``EXISTS``, ``GETRANGE 0 <max_bytes + 40 + 20>``
  (the fleet MAC's envelope is 40 bytes, a head's frame 20) and ``GETRANGE`` of its tail up to a
  quarter of that in the same pipeline, so a planted oversized value costs at most that many bytes
  and is refused as damage (``SIZE_MISMATCH``). ``max_bytes`` is the caller's (``get``,
  ``get_parsed``, ``get_parsed_many``), else :data:`MAX_VALUE_BYTES`. A head whose tail was
  evicted alone is a miss (and deleted); a head and tail of two writes are read again.
* **Names, listed.** ``iter_keys``/``keys`` list the keys this store can read
  (stored under the hash tag its own ``group_of`` gives them); ``iter_names`` lists
  every value under the prefix with the name it is stored under, whatever wrote
  it, and ``get_named`` reads one by that name (``kvcodec verify redis://`` does).
* **Verified reads.** A value is checked (the fleet MAC first when a fleet key
  is set; then the sizes its header declares against its length,
  ``TRUNCATED_PAYLOAD`` / ``SIZE_MISMATCH``; then :func:`kvcodec.format.parse`
  with its CRC) and a value that fails is deleted before its
  :class:`CorruptEncodedKVError` is raised with that check's reason. A key of
  another Redis type (a list, a hash) under a blob's name is damage too
  (``WRONG_TYPE``: deleted), and an empty value (``TRUNCATED_HEADER``); so is damage in either
  part of a split value (both parts deleted).
* **Timeouts and outages.** Every call waits at most ``StoreOptions.timeout_s``
  (default 50 ms, at most :data:`MAX_TIMEOUT_S`) per socket operation (connect,
  send, each read), with no retries, and a call stops at the first node that
  fails: a call on a dead server or node raises
  :class:`~kvcodec.errors.StoreUnavailableError` (``STORE_UNAVAILABLE``, or
  ``STORE_TIMEOUT`` when it ran past its timeout). While the server (or node) is
  down after a timeout, its calls fail at once without I/O, but for one probe per
  ``PROBE_INTERVAL_S`` (1 s) whose answer ends the outage (a refused connection
  costs no wait: the next call asks again). The first failure of an
  outage logs one WARNING, the first success after it one INFO; connections are
  re-made on the next call, so a restarted server serves the same store object.
  Refused credentials or ACL permissions are no outage: they raise
  :class:`~kvcodec.errors.UnsupportedConfigError` (``STORE_AUTH``), logged at ERROR
  at most once a minute; so does a write to a read-only replica (``STORE_READONLY``).
  A reply of a type its command never gives is ``STORE_PROTOCOL``.
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

import math
import re
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, NoReturn

import redis
import redis.cluster

from ..errors import CodecError, CorruptEncodedKVError, Reason, UnsupportedConfigError
from ..format import ParsedBlob, as_bytes_view, parse
from .auth import ENVELOPE_LEN, open_envelope, seal, strip_envelope
from .base import GroupRead, ReadBufferPool, StoreOptions
from .keys import InvalidKeyError, validate_key
from .reading import check_max_blob, check_size
from .redis_calls import AUTH_LOG_INTERVAL_S, RedisCalls, is_wrong_type, scan_page, scan_targets
from .redis_url import CA_CERTS_ENV, PASSWORD_ENV, USERNAME_ENV, RedisURL
from .redis_values import (
    TORN,
    Limits,
    PartDamage,
    concat,
    in_place,
    is_split,
    peek_commands,
    read_commands,
    read_value,
    split,
    tail_name,
)
from .redis_wire import Part

__all__ = [
    "AUTH_LOG_INTERVAL_S",
    "CA_CERTS_ENV",
    "DEFAULT_KEY_PREFIX",
    "MAX_TIMEOUT_S",
    "MAX_VALUE_BYTES",
    "PASSWORD_ENV",
    "USERNAME_ENV",
    "RedisStore",
    "RedisURL",
]

DEFAULT_KEY_PREFIX = "kvcodec"
"""The namespace of a store opened without ``key_prefix`` (the connector's keys carry the model identity)."""
MAX_TIMEOUT_S = 3600.0
"""The longest ``timeout_s`` accepted (a socket takes no infinite or astronomic timeout)."""
MAX_VALUE_BYTES = 512 << 20
"""The most a read holds of one value when its caller names no ``max_bytes``: Redis's own largest string."""

_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:-]{1,100}")
_GROUP_SAFE = re.compile(r"[^{}]+")
_READ_SHAPE = (int, bytes, bytes)
"""The replies of one value's read: ``EXISTS`` (int), ``GETRANGE`` of its head and of its tail (bytes)."""
_TORN_READS = 2
"""Reads again of a value whose head and tail were read between two writes, before it is damage."""
_Fetched = tuple[str, str, Any]


def _check_timeout(timeout: Any) -> float:
    ok = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if not ok or not math.isfinite(timeout) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise UnsupportedConfigError(
            f"timeout_s must be a number in (0, {MAX_TIMEOUT_S:g}] seconds, got {timeout!r}",
            reason=Reason.BAD_VALUE,
        )
    return float(timeout)


def _check_max_bytes(max_bytes: Any) -> int:
    check_max_blob(max_bytes, 0, MAX_VALUE_BYTES)
    return MAX_VALUE_BYTES if max_bytes is None else max_bytes


def _text(name: bytes | str) -> str | None:
    """A listed name as text; None for one that is not UTF-8 (no key of this store is named so)."""
    if isinstance(name, str):
        return name
    try:
        return name.decode()
    except UnicodeDecodeError:
        return None


class RedisStore(RedisCalls):
    """Key -> LMCKV blob store on a Redis server or Redis Cluster (see the module docstring).

    Safe to share between threads (redis-py pools its connections); starts no
    threads. Open one with :meth:`from_url` or :func:`kvcodec.store.open_store`.
    """

    partial_groups = True
    seals_values = True
    """Values carry the fleet MAC when a fleet key is given (:data:`~kvcodec.store.base.SEALS_VALUES`)."""

    def __init__(self, url: RedisURL, options: StoreOptions | None = None) -> None:
        opts = options if options is not None else StoreOptions()
        _check_timeout(opts.timeout_s)
        prefix = opts.key_prefix if opts.key_prefix is not None else DEFAULT_KEY_PREFIX
        if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
            raise UnsupportedConfigError(
                f"key_prefix {prefix!r} must be 1..100 characters of [A-Za-z0-9_.:-]", reason=Reason.BAD_VALUE
            )
        super().__init__(url, opts)
        self._prefix = prefix
        self._group_of: Callable[[str], tuple[str, int, str | None]] | None = opts.group_of

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
        """``put`` each item in order, in one pipeline (per node on a cluster); each ``MSET`` atomic
        (a value over its allocator class by more than a key costs: its head and tail, one slot)."""
        staged = [(self.name_of(k), b) for k, b in items]
        if not staged:
            return
        names = [n for n, _ in staged]
        parts = [split(self._value(n, b)) for n, b in staged]

        def queue(pipe: Any, i: int) -> None:
            head, tail = parts[i]
            pipe.mset({names[i]: head} if tail is None else {tail_name(names[i]): tail, names[i]: head})

        self._pipeline(names, queue, (object,))
        self._count(bytes_written=sum(len(h) + (len(t) if t else 0) for h, t in parts))

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if a value was removed."""
        return bool(self._delete([self.name_of(key)])[0])

    def _delete(self, names: Sequence[str], tails: bool = True) -> list[int]:
        """``DEL`` each name (and, with ``tails``, its tail); per name, whether it was there."""
        every = [*names, *(tail_name(n) for n in names)] if tails else list(names)
        return [r[0] for r in self._pipeline(every, lambda p, i: p.delete(every[i]), (int,))[: len(names)]]

    # ------------------------------------------------------------ reads

    def contains(self, key: str) -> bool:
        """Whether a value is stored under ``key`` (not verified)."""
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """``contains`` of each key, in one pipeline (per node on a cluster; on our own socket where
        reads go there, :meth:`read`) of ``EXISTS``, the value's first bytes (``GETRANGE 0 59``: a
        MAC envelope and a split value's frame) and the tail's ``EXISTS``: a split value whose tail
        was evicted is not there."""
        names = [self.name_of(k) for k in keys]
        replies = self.read(names, lambda i: peek_commands(names[i]), (int, bytes, int))
        return [
            bool(n) and (not is_split(bytes(head.view()) if isinstance(head, Part) else head) or bool(tail))
            for n, head, tail in replies
        ]

    def _fetch(
        self, keys: Sequence[str], names: Sequence[str], max_bytes: Any, buffers: ReadBufferPool | None = None
    ) -> list[_Fetched]:
        """``(key, name, value or None)`` of each name, in one pipeline of ``EXISTS`` + ``GETRANGE`` of
        the head and of the tail, each bounded (:class:`~.redis_values.Limits`): a value read between
        two writes of it is read again (up to twice more). A value of another type, an empty one, a
        longer one or a split one that does not add up is damage: all of them are deleted, then the
        first refused; a head whose tail was evicted is a miss, and deleted."""
        lim = Limits(_check_max_bytes(max_bytes) + ENVELOPE_LEN)
        out = self._fetch_once(keys, names, lim, count=True, buffers=buffers)
        for _ in range(_TORN_READS):
            torn = [i for i, (_, _, v) in enumerate(out) if v is TORN]
            if not torn:
                break
            again = self._fetch_once([keys[i] for i in torn], [names[i] for i in torn], lim, count=False)
            for i, got in zip(torn, again):
                out[i] = got
        torn = PartDamage("its head and tail are of two writes", reason=Reason.CORRUPT)
        damage = [(k, n, torn) for k, n, v in out if v is TORN]
        if damage:
            self._refuse(damage)
        return out

    def _fetch_once(
        self,
        keys: Sequence[str],
        names: Sequence[str],
        lim: Limits,
        count: bool,
        buffers: ReadBufferPool | None = None,
    ) -> list[Any]:
        """One read of ``names`` (one pipeline; its buffer lent by ``buffers`` if given); ``count``:
        hits and misses (not on a read again)."""

        replies = self.read(names, lambda i: read_commands(names[i], lim), _READ_SHAPE, buffers)
        self._count(bytes_read=sum(len(x) for r in replies for x in r[1:] if isinstance(x, (bytes, Part))))
        out: list[Any] = []
        damage: list[tuple[str, str, CorruptEncodedKVError]] = []
        orphans: list[str] = []
        for key, name, (exists, got, tail) in zip(keys, names, replies):
            wrong = (is_wrong_type(got), is_wrong_type(tail))
            assemble = in_place(got, tail) if isinstance(got, Part) and isinstance(tail, Part) else concat
            got, tail = (x.view() if isinstance(x, Part) else x for x in (got, tail))
            try:
                value = read_value(name, exists, got, tail, lim, wrong, assemble)
            except CorruptEncodedKVError as e:
                damage.append((key, name, e))
                value = None
            else:
                if exists and value is None:  # a head whose tail was evicted alone
                    orphans.append(name)
            out.append((key, name, value))
        if count:
            found = sum(1 for r in replies if r[0]) - len(orphans)
            self._count(hits=found, misses=len(names) - found)
        if damage:
            self._refuse(damage)
        if orphans:
            try:
                self._delete(orphans)
            except CodecError:  # the store failing now: still a miss
                pass
        return out

    def _refuse(self, damage: Sequence[tuple[str, str, CorruptEncodedKVError]]) -> NoReturn:
        """Delete every damaged value (one pipeline: its name, and a split value's tail when the tail
        is what is wrong; a tail left behind is never read alone and goes with the next write or
        eviction), count each, raise the first one's error."""
        self._count(errors=len(damage))
        names = [n for _, n, _ in damage] + [tail_name(n) for _, n, e in damage if isinstance(e, PartDamage)]
        try:
            self._delete(names, tails=False)
            where = "deleted"
        except CodecError:  # the store failing now: the refusal still stands
            where = "could not be deleted"
        key, _, e = damage[0]
        raise CorruptEncodedKVError(
            f"stored blob {key!r} in {self.location} is refused: {e}; {where}", reason=e.reason
        ) from None

    def _verified(
        self, key: str, name: str, value: bytes, verify_crc: bool = True, max_bytes: int | None = None
    ) -> ParsedBlob:
        """The parsed blob of one value; a value that fails a check is deleted, then refused."""
        try:
            blob = (
                open_envelope(self._opts.fleet_key, name, value)
                if self._opts.fleet_key
                else strip_envelope(value)
            )
            if max_bytes is not None and len(blob) > max_bytes:
                raise CorruptEncodedKVError(
                    f"{len(blob)} bytes, more than the {max_bytes} its reader expects",
                    reason=Reason.SIZE_MISMATCH,
                )
            check_size(blob, len(blob))  # the header's sizes against the value's, before the CRC
            return parse(blob, verify_crc=verify_crc)
        except CorruptEncodedKVError as e:
            self._refuse([(key, name, e)])

    def get(self, key: str, *, max_bytes: int | None = None) -> memoryview:
        """The verified blob under ``key`` (CRC checked unless ``verify_blobs=False``); KeyError on a miss.
        ``max_bytes``: the largest blob the caller accepts (a longer value is refused unread)."""
        ((_, name, value),) = self._fetch([key], [self.name_of(key)], max_bytes)
        if value is None:
            raise KeyError(key)
        return self._verified(key, name, value, self._opts.verify_blobs, max_bytes).blob

    def get_parsed(
        self,
        key: str,
        into: bytearray | None = None,
        *,
        verify_crc: bool = True,
        max_bytes: int | None = None,
    ) -> ParsedBlob:
        """The blob under ``key``, read in one pipeline and parsed once (its CRC checked unless
        ``verify_crc`` is False; ``into`` unused: the value is a view of the read's buffer)."""
        return self.get_parsed_many([key], verify_crc=verify_crc, max_bytes=max_bytes)[0]

    def get_parsed_many(
        self,
        keys: Sequence[str],
        *,
        verify_crc: bool = True,
        max_bytes: int | None = None,
        buffers: ReadBufferPool | None = None,
    ) -> list[ParsedBlob]:
        """Each key's parsed blob from one pipeline, all or nothing: ``KeyError`` names the first
        missing key; a damaged value is deleted and raises with its check's reason. ``verify_crc``
        False leaves the CRC to the caller (the connector's load checks it in the pass that writes
        the blob, and removes the chunk on a mismatch), as every store does; the fleet MAC, the
        header and the sizes are checked here regardless. ``max_bytes``: the largest blob the caller
        accepts (header + payload); no more of a value is ever read (+ the 40-byte MAC envelope).
        ``buffers``: read on our own socket, the replies go into one buffer lent by it (the blobs view
        it; the caller gives it back once done with them)."""
        fetched = self._fetch(keys, [self.name_of(k) for k in keys], max_bytes, buffers)
        for key, _, value in fetched:
            if value is None:
                raise KeyError(key)
        return [self._verified(k, n, v, verify_crc, max_bytes) for k, n, v in fetched]  # type: ignore[arg-type]

    def read_ahead(self, reads: Sequence[GroupRead]) -> None:
        """Ask for ``reads`` now (see :class:`~kvcodec.store.BlobStore`) on our own sockets
        (:meth:`~.redis_wire.Wire.read_ahead`; on a cluster, each node its own reads); TLS, or reads
        through redis-py ignore the hint. A server that fails here is an outage, as on any call;
        nothing is raised. Nothing is built for servers it would not send to (:meth:`reads_ahead`)."""
        if reads and not self.reads_ahead():
            return
        try:
            groups = []
            for r in reads:
                lim = Limits(_check_max_bytes(r.max_bytes) + ENVELOPE_LEN)
                groups.append([c for k in r.keys for c in read_commands(self.name_of(k), lim)])
            self.send_ahead(groups)
        except CodecError:  # a hint: the reads themselves fail fast or find what is wrong
            pass

    def get_named(self, name: str, *, max_bytes: int | None = None) -> memoryview:
        """The verified blob stored under the full Redis ``name`` (as :meth:`iter_names` lists it,
        whatever hash tag its writer gave it); KeyError on a miss."""
        key = self._key_of(name) if isinstance(name, str) else None
        if key is None:
            raise InvalidKeyError(f"{name!r} is not a name under the prefix {self._prefix!r}")
        ((_, _, value),) = self._fetch([key], [name], max_bytes)
        if value is None:
            raise KeyError(name)
        return self._verified(key, name, value, self._opts.verify_blobs, max_bytes).blob

    def iter_names(self) -> Iterator[tuple[str, str]]:
        """``(key, name)`` of every value under this store's prefix, by ``SCAN`` (node after node on a
        cluster), the name as stored: bounded memory; a value written or removed during the scan may
        or may not be listed."""
        match = f"{self._prefix}:{{*"  # the prefix has no glob characters
        for node_name, node in self._call(scan_targets, trips=0):
            cursor = None
            while cursor != 0:
                cursor, names = self._call(
                    lambda c, node=node, at=cursor or 0: scan_page(node, at, match), node=node_name
                )
                for name in names:
                    key = self._key_of(name)
                    text = _text(name)
                    if key is not None and text is not None:
                        yield key, text

    def iter_keys(self) -> Iterator[str]:
        """Every key this store can read (its name carries the tag this store's ``group_of`` gives),
        by ``SCAN``: bounded memory; a key written or removed during the scan may or may not be listed."""
        for key, name in self.iter_names():
            if self.name_of(key) == name:
                yield key

    def keys(self) -> list[str]:
        """Every key this store can read, sorted (one SCAN pass)."""
        return sorted(self.iter_keys())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.contains(key)

    def used_memory(self) -> int:
        """The servers' ``used_memory`` summed (bytes; every primary of a cluster): what the store costs."""

        def run(client: Any) -> int:
            if isinstance(client, redis.cluster.RedisCluster):
                infos = list(client.info("memory", target_nodes=client.PRIMARIES).values())
            else:
                infos = [client.info("memory")]
            return sum(int(node["used_memory"]) for node in infos)

        return self._call(run)

    # ------------------------------------------------------------ plumbing

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RedisStore({self.location!r}, key_prefix={self._prefix!r}, mac={bool(self._opts.fleet_key)})"

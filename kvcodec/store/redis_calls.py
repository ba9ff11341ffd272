"""How RedisStore talks to Redis: one pipeline per call (per node on a cluster), each bounded by the
store's timeout, with redis-py's failures and replies turned into kvcodec's errors.

* **Per node, ourselves.** On a cluster the names of one call are grouped by the node that serves
  them (the client's slot map) and each node gets one plain pipeline; the call stops at the first
  node that fails. redis-py's cluster pipeline would resend each command of a silent node on a fresh
  connection, one timeout each (a lookup of 128 chunks stalled ~80 timeouts). Only a redirection
  (``MOVED``, ``ASK``, ``TRYAGAIN``, ``CLUSTERDOWN``: a resharding or a failover) sends that node's
  names through redis-py's cluster pipeline, which follows it and refreshes the slot map.
* **Replies checked.** Every reply must be of the type its command gives (a ``GET``-like read
  bytes, ``EXISTS`` an integer, ``SCAN`` a cursor and a list): anything else is
  :class:`~kvcodec.errors.StoreUnavailableError` with ``STORE_PROTOCOL`` (not a Redis, or a broken
  proxy), as is a reply redis-py itself cannot parse. ``WRONGTYPE`` (a list or hash under a blob's
  name) is handed back to the caller, which treats it as damage.
* **Failures.** A timeout is ``STORE_TIMEOUT``; a refused connection or a node down
  ``STORE_UNAVAILABLE`` (the target marked down: :mod:`.redis_outage`); a refused login or command
  ``STORE_AUTH`` and a read-only replica ``STORE_READONLY`` (configuration errors, one ERROR line a
  minute, no outage); ``OOM`` :class:`~kvcodec.store.StoreFullError`.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NoReturn, TypeVar

import redis
import redis.cluster
from redis.crc import key_slot

from ..env import redis_reads
from ..errors import Reason, StoreUnavailableError, UnsupportedConfigError
from . import redis_outage
from .base import ReadBufferPool, StoreFullError, StoreOptions
from .counters import Counters
from .redis_outage import Outages
from .redis_url import RedisURL, auth_refusal, connect
from .redis_wire import BadReply, Command, Part, Wire

__all__ = [
    "AUTH_LOG_INTERVAL_S",
    "SCAN_COUNT",
    "BadReply",
    "Queue",
    "RedisCalls",
    "WireRead",
    "is_wrong_type",
    "scan_page",
    "scan_targets",
]

log = logging.getLogger("kvcodec.store.redis")

AUTH_LOG_INTERVAL_S = 60.0
"""At most one ERROR line per this many seconds for refused credentials, permissions or writes."""

Queue = Callable[[Any, int], None]
"""``queue(pipe, i)`` adds the commands of the call's ``i``-th name to ``pipe``."""
CommandsOf = Callable[[int], Sequence[Command]]
"""``commands_of(i)``: the commands of the call's ``i``-th name (a read sent on the wire)."""

_NODE_IN_ERROR = re.compile(r"(?:connecting to|reading from|writing to) \[?([\w.:-]+?)\]?:(\d+)")
"""A node in redis-py's error text ("Error 111 connecting to 10.0.0.5:7001."), when it names one."""
_REDIRECTS = (
    redis.exceptions.AskError,  # MovedError is one too
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
)
_UNPARSABLE = (TypeError, ValueError, IndexError, KeyError, AttributeError, UnicodeError)
"""What redis-py's reply parsers raise on a reply its command never gives (an int for SCAN's list)."""
_T = TypeVar("_T")


def is_wrong_type(reply: Any) -> bool:
    """Whether ``reply`` is Redis's ``WRONGTYPE`` error (a key holding another kind of value)."""
    return isinstance(reply, redis.exceptions.ResponseError) and str(reply).startswith("WRONGTYPE")


def _run(
    client: Any, names: Sequence[str], idx: Sequence[int], queue: Queue, shape: tuple[type, ...]
) -> list:
    """One pipeline of ``queue``'s commands for each index; per index the list of its replies."""
    pipe = client.pipeline(transaction=False)
    for i in idx:
        queue(pipe, i)
    return _checked(pipe.execute(raise_on_error=False), len(idx), shape)


@dataclass(frozen=True)
class WireRead:
    """A read that may go on our own socket: its commands per name, and where its buffer may come from."""

    commands_of: CommandsOf
    buffers: ReadBufferPool | None = None


def _run_wire(wire: Wire, idx: Sequence[int], read: WireRead, shape: tuple[type, ...]) -> list:
    """:func:`_run` on our own socket: bulk replies are :class:`~.redis_wire.Part` of one buffer."""
    commands = [c for i in idx for c in read.commands_of(i)]
    return _checked(wire.read(commands, read.buffers), len(idx), shape)


def _checked(flat: Any, n: int, shape: tuple[type, ...]) -> list:
    """Per index the list of its replies, each of its command's type (a bulk: bytes or a Part);
    an error reply other than ``WRONGTYPE`` is raised."""
    per = len(shape)
    if not isinstance(flat, list) or len(flat) != per * n:
        raise BadReply(f"a pipeline of {per * n} commands was answered by {type(flat).__name__}")
    for j, reply in enumerate(flat):
        want = (bytes, Part) if shape[j % per] is bytes else shape[j % per]
        if isinstance(reply, Exception):
            if not is_wrong_type(reply):
                raise reply
        elif not isinstance(reply, want):
            raise BadReply(f"a {shape[j % per].__name__} reply was expected, got {type(reply).__name__}")
    return [flat[k * per : (k + 1) * per] for k in range(n)]


SCAN_COUNT = 1000
"""Names asked for per ``SCAN`` page."""


def scan_targets(client: Any) -> list[tuple[str | None, Any]]:
    """``(node name, plain client)`` per server to SCAN: the client itself, or each primary of a cluster."""
    if isinstance(client, redis.cluster.RedisCluster):
        return [(n.name, client.get_redis_connection(n)) for n in client.get_primaries()]
    return [(None, client)]


def scan_page(node: Any, cursor: int, match: str) -> tuple[int, list[Any]]:
    """One ``SCAN`` page of ``node``, its reply's types checked."""
    reply = node.scan(cursor, match=match, count=SCAN_COUNT)
    if not isinstance(reply, (tuple, list)) or len(reply) != 2:
        raise BadReply(f"SCAN answered {type(reply).__name__}")
    at, names = reply
    if isinstance(at, bool) or not isinstance(at, int) or at < 0 or not isinstance(names, list):
        raise BadReply(f"SCAN answered a cursor {type(at).__name__} and {type(names).__name__}")
    if not all(isinstance(n, (bytes, str)) for n in names):
        raise BadReply("SCAN listed a name that is not a string")
    return at, names


def _node_groups(client: Any, names: Sequence[str]) -> list[tuple[str, Any, list[int]]] | None:
    """``(node name, its client, indices)`` per cluster node serving ``names``; None for one server."""
    if not isinstance(client, redis.cluster.RedisCluster):
        return None
    groups: dict[str, tuple[str, Any, list[int]]] = {}
    for i, name in enumerate(names):
        node = client.get_node_from_key(name)
        groups.setdefault(node.name, (node.name, client.get_redis_connection(node), []))[2].append(i)
    return list(groups.values())


class RedisCalls:
    """The plumbing of :class:`kvcodec.store.redis.RedisStore`: connection, calls, outages, counters."""

    def __init__(self, url: RedisURL, opts: StoreOptions) -> None:
        self._url = url
        self._opts = opts
        self._lock = threading.Lock()
        self._client: Any = None
        self._cluster = bool(url.cluster)
        self._down = Outages()
        """What is out: the server (its location), or on a cluster each node (``host:port``) that failed."""
        self._config_logged: dict[Reason, float] = {}
        self._closed = False
        self._counts = Counters()
        self._wires: dict[int, tuple[Any, Wire | None]] = {}
        """Per client (the server's, or a cluster node's): it, and the Wire to its server."""
        self.location = url.location

    # ------------------------------------------------------------ pipelines

    def read(
        self,
        names: Sequence[str],
        commands_of: CommandsOf,
        shape: tuple[type, ...],
        buffers: ReadBufferPool | None = None,
    ) -> list[list[Any]]:
        """:meth:`_pipeline` of the commands ``commands_of`` gives per name, sent on our own socket
        (:mod:`.redis_wire`: bulk replies are Parts of one buffer, lent by ``buffers`` if given)
        unless the server speaks TLS or ``KVCODEC_REDIS_READS=client``; else through redis-py (bulk
        replies are bytes)."""

        def queue(pipe: Any, i: int) -> None:
            for c in commands_of(i):
                pipe.execute_command(*c.args)

        return self._pipeline(names, queue, shape, WireRead(commands_of, buffers))

    def _pipeline(
        self,
        names: Sequence[str],
        queue: Queue,
        shape: tuple[type, ...],
        wire_read: WireRead | None = None,
    ) -> list[list[Any]]:
        """Per name, the replies of the commands ``queue`` adds for it (``shape``: each one's type), in
        one pipeline, or one per node on a cluster; the call fails at the first node that fails."""
        if not names:
            return []
        if self._down:
            self._fail_fast(names)
        groups = self._call(lambda c: _node_groups(c, names), trips=0, checked=True)
        every = list(range(len(names)))
        if groups is None:
            return self._call(
                lambda c: self._run_on(c, names, every, queue, shape, wire_read), names, checked=True
            )
        out: list[list[Any]] = [[] for _ in names]
        for node, node_client, idx in groups:
            sub = [names[i] for i in idx]
            got = self._call(
                lambda c, n=node_client, i=idx: self._run_node(c, n, names, i, queue, shape, wire_read),
                sub,
                node=node,
                checked=True,
            )
            for i, replies in zip(idx, got):
                out[i] = replies
        return out

    def send_ahead(self, groups: Sequence[Sequence[Command]]) -> None:
        """Send ``groups`` ahead of the reads that will ask for them (:meth:`.Wire.read_ahead`), where
        reads go on the wire: on a cluster each node is sent its own groups (a group's values share a
        hash tag: one slot, one node). Else nothing. Empty: drop this thread's read-ahead (on every
        node). Failures are the store's as in any call (the target marked down); no round trip is
        counted."""
        if groups and self._down:
            return
        if not groups and self._client is None:
            return

        def send(client: Any) -> None:
            for wire, mine in self._ahead_targets(client, groups):
                wire.read_ahead(mine)

        self._call(send, trips=0)

    def reads_ahead(self) -> bool:
        """Whether a read-ahead may send anything, asked before its commands are built: not once no
        server reached reads ahead (:meth:`.Wire.reads_ahead`: ``KVCODEC_REDIS_READ_AHEAD`` and the
        server's host) or all are read through redis-py; before any is reached, maybe."""
        with self._lock:
            wires = [w for _, w in self._wires.values()]
        return not wires or any(w is not None and w.reads_ahead() for w in wires)

    def _ahead_targets(self, client: Any, groups: Sequence[Sequence[Command]]) -> list[tuple[Wire, list]]:
        """``(wire, its groups)`` per server a read-ahead goes to: the one server, or on a cluster each
        node, told the commands of each group on its slots, in order (what the read's pipeline to that
        node will send; the connector's chunks are one slot each), and to drop, every node's wire. A
        node told nothing keeps an earlier hint only until its next read, which drops it."""
        if not isinstance(client, redis.cluster.RedisCluster):
            wire = self._wire_of(client)
            return [] if wire is None else [(wire, list(groups))]
        if not groups:
            with self._lock:
                return [(w, []) for _, w in self._wires.values() if w is not None]
        nodes: dict[int, Any] = {}
        per: dict[str, tuple[Any, list]] = {}
        for g in groups:
            parts: dict[str, list[Command]] = {}
            for c in g:
                slot = key_slot(str(c.args[1]).encode())
                node = nodes.get(slot) or nodes.setdefault(
                    slot, client.nodes_manager.get_node_from_slot(slot)
                )
                parts.setdefault(node.name, []).append(c)
                per.setdefault(node.name, (client.get_redis_connection(node), []))
            for name, part in parts.items():
                per[name][1].append(part)
        targets = [(self._wire_of(node_client), mine) for node_client, mine in per.values()]
        return [(w, mine) for w, mine in targets if w is not None]

    def _run_on(
        self,
        client: Any,
        names: Sequence[str],
        idx: Sequence[int],
        queue: Queue,
        shape: tuple[type, ...],
        wire_read: WireRead | None,
    ) -> list:
        """One pipeline on ``client``'s server: on the wire when the call has commands and can."""
        wire = self._wire_of(client) if wire_read is not None else None
        if wire is None:
            return _run(client, names, idx, queue, shape)
        return _run_wire(wire, idx, wire_read, shape)  # type: ignore[arg-type]

    def _run_node(
        self,
        client: Any,
        node: Any,
        names: Sequence[str],
        idx: list[int],
        queue: Queue,
        shape: tuple[type, ...],
        wire_read: WireRead | None,
    ) -> list:
        """One node's pipeline; a redirection sends its names through the cluster client instead."""
        try:
            return self._run_on(node, names, idx, queue, shape, wire_read)
        except _REDIRECTS:
            return _run(client, names, idx, queue, shape)

    def _wire_of(self, client: Any) -> Wire | None:
        """The :class:`~.redis_wire.Wire` to ``client``'s server (made once per client), or None:
        TLS, or reads through redis-py asked for."""
        if redis_reads() != "wire":
            return None
        with self._lock:
            got = self._wires.get(id(client))
            if got is None or got[0] is not client:
                got = (client, Wire.of(client))
                self._wires[id(client)] = got
            return got[1]

    # ------------------------------------------------------------ one call

    def _call(
        self,
        fn: Callable[[Any], _T],
        names: Sequence[str] = (),
        trips: int | None = None,
        node: str | None = None,
        checked: bool = False,
    ) -> _T:
        """``fn(client)`` on the values ``names`` (one round trip, or one per slot on a cluster, unless
        ``trips`` says) of ``node`` (None: the store, or the nodes serving ``names``), redis-py's
        failures turned into kvcodec's errors and each outage logged once. ``checked``: the caller
        has already refused a call to a target that is down."""
        trips = self._trips(names) if trips is None else trips
        if not checked and self._down and (trips or self._client is None):  # listing nodes is no probe
            self._fail_fast(names, node)
        try:
            client = self._connected()
            out = fn(client)
        except redis.exceptions.TimeoutError as e:
            self._failed(Reason.STORE_TIMEOUT, e, names, node)
        except redis.exceptions.OutOfMemoryError as e:
            self._count(errors=1)
            raise StoreFullError(f"{self.location} refused a write: {e}") from None
        except redis.exceptions.ReadOnlyError as e:
            self._config_error(
                UnsupportedConfigError(
                    f"Redis store {self.location} is a read-only replica: name its primary in the URL",
                    reason=Reason.STORE_READONLY,
                ),
                e,
            )
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
            refusal = auth_refusal(e, self.location)
            if refusal is not None:
                self._config_error(refusal, e)
            self._failed(Reason.STORE_UNAVAILABLE, e, names, node)
        except _UNPARSABLE as e:  # BadReply, or redis-py failing on a reply no Redis gives
            self._failed(Reason.STORE_PROTOCOL, e, names, node)
        self._count(round_trips=trips)
        if self._down and trips:  # only an answer from a server ends an outage
            self._mend(client, names, node)
        return out

    def _trips(self, names: Sequence[str]) -> int:
        """Round trips of one pipeline over ``names``: one, or one per slot on a cluster."""
        if not self._cluster or len(names) < 2:
            return 1
        return len({key_slot(n.encode()) for n in names})

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

    # ------------------------------------------------------------ outages

    def _target(self, e: BaseException, names: Sequence[str], node: str | None) -> str:
        """What failed: on a cluster the node the call was for, or the one redis-py names, or the one
        node that serves ``names``, or the node the error's text names; else the store as a whole."""
        if not self._cluster:
            return self.location
        if node is not None:
            return node
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

    def _fail_fast(self, names: Sequence[str], node: str | None = None) -> None:
        """Raise at once, without I/O, when a target of this call is down and not due for a probe."""
        targets = {self.location} | (self._nodes_of(names) if self._cluster else set())
        target = self._down.blocked(targets | ({node} if node else set()))
        if target is not None:
            self._count(errors=1)
            where = "" if target == self.location else f" (node {target})"
            raise StoreUnavailableError(
                f"store {self.location}{where} is down; it is probed again within {redis_outage.PROBE_INTERVAL_S} s",
                reason=Reason.STORE_UNAVAILABLE,
            )

    def _config_error(self, error: UnsupportedConfigError, e: BaseException) -> NoReturn:
        """Raise ``error``, a configuration error (no outage), with one ERROR line a minute per kind."""
        self._count(errors=1)
        now = time.monotonic()
        if now - self._config_logged.get(error.reason, -AUTH_LOG_INTERVAL_S - 1.0) >= AUTH_LOG_INTERVAL_S:
            self._config_logged[error.reason] = now
            log.error("kvcodec %s (%s): calls fail until the store's configuration is fixed", error, e)
        raise error from None

    def _failed(self, reason: Reason, e: BaseException, names: Sequence[str], node: str | None) -> NoReturn:
        self._count(**{"timeouts" if reason is Reason.STORE_TIMEOUT else "errors": 1})
        target = self._target(e, names, node)
        first = self._down.failed(target, costly=reason is Reason.STORE_TIMEOUT)
        what = f"{type(e).__name__}: {e}"
        if reason is Reason.STORE_PROTOCOL:
            what = f"a reply no Redis gives ({what})"
        if first:
            where = "" if target == self.location else f" (node {target})"
            log.warning(
                "kvcodec store %s%s is unavailable (%s): lookups miss and saves are dropped until it is back",
                self.location,
                where,
                what,
            )
        raise StoreUnavailableError(f"store {self.location}: {what}", reason=reason) from None

    def _mend(self, client: Any, names: Sequence[str], node: str | None) -> None:
        """End the outages an answer disproves: the store's; on a cluster also those of the node the
        call was for, or of the nodes that served ``names``."""
        back: set[str] | None = None  # one server: any answer is all of it
        if isinstance(client, redis.cluster.RedisCluster):
            back = {self.location} | ({node} if node else self._nodes_of(names))
        for target in self._down.mend(back):
            where = "" if target == self.location else f" (node {target})"
            log.info("kvcodec store %s%s is reachable again", self.location, where)

    # ------------------------------------------------------------ the rest

    def stats(self) -> dict[str, float]:
        """Cumulative counters (:data:`~kvcodec.store.STORE_COUNTERS`): ``round_trips`` counts pipelines
        (one per slot on a cluster), ``hits``/``misses`` keys found or not by the reads that return
        blobs (``get``, ``get_parsed``, ``get_parsed_many``; not ``contains``), ``errors`` failed calls
        that did not time out (also those refused at once during an outage) plus refused values."""
        return self._counts.snapshot()

    def _count(self, **deltas: float) -> None:
        self._counts.add(**deltas)

    def close(self) -> None:
        """Drop the connections (no network wait); later calls raise."""
        self._closed = True
        with self._lock:
            client, self._client = self._client, None
            wires, self._wires = list(self._wires.values()), {}
        for _, wire in wires:
            if wire is not None:
                wire.close()
        if client is not None:
            try:
                client.close()
            except (redis.exceptions.RedisError, OSError):  # pragma: no cover - a socket already gone
                pass

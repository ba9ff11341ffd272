"""Bulk reads on sockets of our own: one pipeline's replies received straight into one buffer.

redis-py hands each reply over as a new ``bytes`` (with hiredis: received into the client's buffer,
fed to hiredis's, copied out), which made a 2.4 MB chunk read ~2.7x slower than the socket allows
(``bench/fleet/wire.py``). Here a read's commands go out in one ``sendall`` and the replies are
``recv_into`` one buffer sized by the reader's own bounds; a value is a read-only view of it, and
a value stored in two parts is put back together in place (:func:`.redis_values.join_in_place`).

A reader that knows its next reads (the connector's load: a request's chunks, in order) may send
them ahead (:meth:`Wire.read_ahead`): Redis then prepares the next chunk's replies on its own core
while this one is received and checked, instead of waiting for each request in turn. At most
:data:`READ_AHEAD_BYTES` of replies (by the commands' bounds) are asked for ahead of the reads that
take them, so Redis never buffers more than that for one reader.

Only what a read needs is spoken: RESP2 integers, bulk strings, errors and simple strings; an
array, a bulk longer than its command can return, or a line longer than :data:`MAX_LINE` is a
reply no Redis gives (:class:`BadReply`). Failures are redis-py's own exceptions
(``TimeoutError``, ``ConnectionError``, Redis's error replies parsed as redis-py parses them), so
the caller maps them to kvcodec's errors in one place. A socket goes back to the idle list only
after a whole pipeline was read; any failure closes it. TLS and RESP3 servers are left to redis-py
(:meth:`Wire.of` gives None).
"""

from __future__ import annotations

import ipaddress
import re
import select
import socket
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import redis
import redis.connection

from ..env import redis_read_ahead
from .base import ReadBufferPool

__all__ = [
    "MAX_IDLE",
    "MAX_LINE",
    "READ_AHEAD_BYTES",
    "UP_FRONT",
    "BadReply",
    "Command",
    "Part",
    "Wire",
    "bound",
    "pack",
    "receive",
]

MAX_LINE = 4096
"""The longest reply line (type, integer, error text) read before it is refused."""
MAX_IDLE = 4
"""Idle sockets kept per server (the connector's loads run on at most a few threads)."""
_INTEGER = re.compile(rb"-?[0-9]{1,19}")
_QUICK_LINE = 20
"""A reply line parsed inline: a type byte, at most 17 digits, CRLF (anything else: the full parser)."""
_COLON, _DOLLAR = ord(":"), ord("$")
UP_FRONT = 64 << 20
"""A pipeline whose replies may take up to this many bytes (its commands' bounds) gets its whole
buffer at once: the connector's chunk reads, bounded by the blob size it expects."""
_START = 1 << 20
"""A larger bound (a read without ``max_bytes``: Redis's 512 MiB) starts here and grows as replies
arrive, doubling, never past the bound: memory follows what was sent, not what may be."""


READ_AHEAD_BYTES = 16 << 20
"""The most reply bytes (by the commands' bounds) asked for ahead of the reads that take them (at
least one group): what Redis buffers for one reader, and what a read-ahead dropped unread may waste.
16 MiB: a few chunks of a large model's layers."""
_PEEK = 4096
"""With replies of later commands behind these, a receive takes at most this many bytes past what
the reply at hand needs (its next line): the next group's bytes mostly stay in the socket."""


class BadReply(ValueError):
    """A reply of a type its command never gives."""


class Command(NamedTuple):
    """One command of a pipeline and the longest bulk reply it may return (0: none expected).

    A tuple, not a dataclass: a lookup makes three per key, hundreds per prompt."""

    args: tuple[str | bytes | int, ...]
    max_bulk: int = 0


def pack(commands: Sequence[Command]) -> bytes:
    """The RESP2 request of ``commands`` (arrays of bulk strings)."""
    out: list[bytes] = []
    add = out.append
    for args, _ in commands:
        add(b"*%d\r\n" % len(args))
        for a in args:
            b = a.encode() if a.__class__ is str else a if a.__class__ is bytes else str(a).encode()
            add(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


@dataclass(frozen=True)
class Part:
    """A bulk reply: bytes ``start:end`` of its pipeline's buffer (shared by the pipeline's replies)."""

    buf: bytearray
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start

    def view(self) -> memoryview:
        """A read-only view of the reply's bytes (no copy)."""
        return memoryview(self.buf)[self.start : self.end].toreadonly()


def bound(commands: Sequence[Command]) -> int:
    """The most bytes the replies of ``commands`` may take (each bulk's bound and its framing)."""
    return sum(c.max_bulk + 64 for c in commands)


@dataclass
class _Ahead:
    """A thread's read-ahead: its socket, the groups sent and not yet read, those still to send."""

    sock: socket.socket
    sent: deque[tuple[Command, ...]]
    later: deque[tuple[Command, ...]]
    early: bytes = b""
    """Bytes received with the group before: the start of the next group's replies."""


class _Reader:
    """The replies of one pipeline off one socket, parsed as they arrive."""

    def __init__(
        self,
        sock: Any,
        commands: Sequence[Command],
        early: bytes = b"",
        buffers: ReadBufferPool | None = None,
    ) -> None:
        self.sock = sock
        self.commands = commands
        self.bound = bound(commands)
        size = max(len(early), self.bound if self.bound <= UP_FRONT else _START)
        self.buf = buffers.lend(size) if buffers is not None else bytearray(size)
        self.buf[: len(early)] = early
        self.got = len(early)
        self.pos = 0
        self.more = False

    def read(self, more: bool = False) -> list[Any]:
        """The replies; ``more``: the replies of commands sent after these may follow (kept, see
        :meth:`rest`), else any byte after the last reply is one no command asked for."""
        self.more = more
        items = self._replies()
        if self.got != self.pos and not more:
            raise BadReply(f"{self.got - self.pos} bytes after the last reply")
        return [Part(self.buf, x.start, x.stop) if isinstance(x, slice) else x for x in items]

    def rest(self) -> bytes:
        """The bytes received after the last reply: the start of the next group's replies."""
        return bytes(self.buf[self.pos : self.got])

    def _replies(self) -> list[Any]:
        """Each command's reply: the common ones (a short non-negative integer, a whole bulk within
        its bound, both in the buffer already) parsed inline, any other by :meth:`_reply`. A lookup
        is hundreds of tiny replies: a few calls each made it ~3x slower than the socket."""
        out: list[Any] = []
        add = out.append
        buf, pos, got = self.buf, self.pos, self.got
        for c in self.commands:
            end = buf.find(b"\r\n", pos, min(got, pos + _QUICK_LINE))
            digits = buf[pos + 1 : end] if end > pos else b""
            if digits.isdigit() and buf[pos] == _COLON:
                add(int(digits))
                pos = end + 2
                continue
            if digits.isdigit() and buf[pos] == _DOLLAR:
                start = end + 2
                stop = start + int(digits)
                if stop - start <= c.max_bulk and stop + 2 <= got and buf[stop : stop + 2] == b"\r\n":
                    add(slice(start, stop))
                    pos = stop + 2
                    continue
            self.pos = pos
            add(self._reply(c))
            buf, pos, got = self.buf, self.pos, self.got
        self.pos = pos
        return out

    def _reply(self, c: Command) -> Any:
        kind, line = self._line()
        if kind == b":":
            return self._integer(line)
        if kind == b"$":
            return self._bulk(self._integer(line), c.max_bulk)
        if kind == b"-":
            return redis.connection.BaseParser.parse_error(line.decode("utf-8", "replace"))
        if kind == b"+":
            return line.decode("utf-8", "replace")
        raise BadReply(f"a reply of type {kind!r}")

    def _line(self) -> tuple[bytes, bytes]:
        while True:
            end = self.buf.find(b"\r\n", self.pos, self.got)
            if end >= 0:
                break
            if self.got - self.pos > MAX_LINE:
                raise BadReply(f"a reply line of over {MAX_LINE} bytes")
            self._fill(self.got + 1)
        kind, line = bytes(self.buf[self.pos : self.pos + 1]), bytes(self.buf[self.pos + 1 : end])
        self.pos = end + 2
        return kind, line

    def _integer(self, line: bytes) -> int:
        if not _INTEGER.fullmatch(line):
            raise BadReply(f"{line[:32]!r} where an integer belongs")
        return int(line)

    def _bulk(self, n: int, most: int) -> slice | None:
        if n == -1:
            return None
        if not 0 <= n <= most:
            raise BadReply(f"a {n}-byte string where at most {most} can come")
        start, end = self.pos, self.pos + n
        self._fill(end + 2)
        if self.buf[end : end + 2] != b"\r\n":
            raise BadReply("a string without its CRLF")
        self.pos = end + 2
        return slice(start, end)

    def _fill(self, need: int) -> None:
        """Receive until ``need`` bytes are in (as many more as arrive and fit)."""
        if need > len(self.buf):
            grown = bytearray(max(need, min(2 * len(self.buf), self.bound)))
            grown[: self.got] = memoryview(self.buf)[: self.got]
            self.buf = grown
        stop = min(len(self.buf), need + _PEEK) if self.more else len(self.buf)
        while self.got < need:
            with memoryview(self.buf) as mv:
                try:
                    n = self.sock.recv_into(mv[self.got : stop])
                except TimeoutError:
                    raise redis.exceptions.TimeoutError("Timeout reading from socket") from None
                except OSError as e:
                    raise redis.exceptions.ConnectionError(f"Error while reading from socket: {e}") from None
            if n == 0:
                raise redis.exceptions.ConnectionError("Connection closed by server.")
            self.got += n


def receive(sock: Any, commands: Sequence[Command]) -> list[Any]:
    """The replies of ``commands`` (already sent) off ``sock`` (``recv_into``), parsed as they
    arrive into one buffer; see :meth:`Wire.read` for what each reply becomes."""
    return _Reader(sock, commands).read()


class Wire:
    """Sockets to one Redis server, opened as redis-py's client for it would open them."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self._kwargs = kwargs
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._local = threading.local()
        self._aheads: set[socket.socket] = set()
        """Sockets of read-aheads in flight (closed with the Wire)."""

    @classmethod
    def of(cls, client: Any) -> Wire | None:
        """A Wire to the server of a plain ``redis.Redis`` client (TCP or Unix socket), or None: TLS,
        RESP3, or a client of another kind."""
        pool = getattr(client, "connection_pool", None)
        kwargs = getattr(pool, "connection_kwargs", None)
        conn_class = getattr(pool, "connection_class", None)
        plain = (redis.connection.Connection, redis.connection.UnixDomainSocketConnection)
        if (
            not isinstance(kwargs, dict)
            or conn_class not in plain
            or kwargs.get("protocol") not in (None, 2, "2")
        ):
            return None
        return cls(dict(kwargs))

    def read(self, commands: Sequence[Command], buffers: ReadBufferPool | None = None) -> list[Any]:
        """Send ``commands`` in one write and receive their replies into one buffer: per command an
        ``int``, a :class:`Part` (a bulk string), None (a nil bulk), a ``str`` (a simple string) or
        the redis-py ``ResponseError`` of an error reply. The buffer is taken from ``buffers`` when
        given (lent: the caller gives it back). Commands this thread sent ahead
        (:meth:`read_ahead`) are received, not sent again; any other read drops the read-ahead."""
        ahead = getattr(self._local, "ahead", None)
        if ahead is not None:
            if ahead.sent and ahead.sent[0] == tuple(commands):
                return self._take_ahead(ahead, buffers)
            self.drop_ahead()
        sock = self._take()
        try:
            sock.sendall(pack(commands))
            replies = _Reader(sock, commands, buffers=buffers).read()
        except BaseException:
            sock.close()
            raise
        self._give_back(sock)
        return replies

    def read_ahead(self, groups: Sequence[Sequence[Command]]) -> None:
        """Send the first of ``groups`` now (up to :data:`READ_AHEAD_BYTES` of replies, at least one
        group), the rest as the reads before them are taken: the next :meth:`read` calls of this thread
        that ask for exactly these groups, in order, receive their replies. Drops the thread's
        earlier read-ahead; empty ``groups``, or a server this Wire does not read ahead from
        (:meth:`reads_ahead`): only that. A failure to send drops it and is raised."""
        self.drop_ahead()
        if not groups or not self.reads_ahead():
            return
        ahead = _Ahead(self._take(), deque(), deque(tuple(g) for g in groups))
        with self._lock:
            self._aheads.add(ahead.sock)
        self._local.ahead = ahead
        try:
            self._send_more(ahead)
        except BaseException:
            self.drop_ahead()
            raise

    def reads_ahead(self) -> bool:
        """Whether :meth:`read_ahead` sends anything (``KVCODEC_REDIS_READ_AHEAD``): ``auto`` only to a
        server across a network. One on this host (loopback, a Unix socket) would build the replies
        sent ahead on the cores the caller is checking and writing the chunk before on: measured in
        the engine on a 2-core host, a hit 8 ms slower with it (docs/fleet.md)."""
        mode = redis_read_ahead()
        return mode == "on" or (mode == "auto" and not self.on_this_host)

    @property
    def on_this_host(self) -> bool:
        """The server is reached through a Unix socket or a loopback address (by name: localhost)."""
        k = self._kwargs
        if k.get("path"):
            return True
        host = str(k.get("host", "")).strip("[]").lower()
        if host == "localhost" or host.endswith(".localhost"):
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    def drop_ahead(self) -> None:
        """Forget this thread's read-ahead; its socket, with replies maybe unread, is closed."""
        ahead = getattr(self._local, "ahead", None)
        if ahead is not None:
            self._end_ahead(ahead).close()

    def _end_ahead(self, ahead: _Ahead) -> socket.socket:
        """Forget ``ahead`` (this thread's read-ahead); its socket, for the caller to close or reuse."""
        self._local.ahead = None
        with self._lock:
            self._aheads.discard(ahead.sock)
        return ahead.sock

    def _send_more(self, ahead: _Ahead) -> None:
        """Send the groups still to send, while the replies outstanding stay within the bound."""
        pending, out = sum(bound(g) for g in ahead.sent), []
        while ahead.later and (
            not (ahead.sent or out) or pending + bound(ahead.later[0]) <= READ_AHEAD_BYTES
        ):
            group = ahead.later.popleft()
            pending += bound(group)
            out.append(group)
        if out:
            ahead.sock.sendall(pack([c for g in out for c in g]))
            ahead.sent.extend(out)

    def _take_ahead(self, ahead: _Ahead, buffers: ReadBufferPool | None) -> list[Any]:
        """The replies of the oldest group sent ahead; the socket goes back once every group is read."""
        commands = ahead.sent.popleft()
        try:
            reader = _Reader(ahead.sock, commands, ahead.early, buffers)
            replies = reader.read(more=bool(ahead.sent or ahead.later))
            ahead.early = reader.rest()
            self._send_more(ahead)
        except BaseException:
            self.drop_ahead()
            raise
        if not ahead.sent:  # every group read: nothing left on the socket
            self._give_back(self._end_ahead(ahead))
        return replies

    def _take(self) -> socket.socket:
        """An idle socket the server has not closed (a restarted server's EOF, or bytes nobody asked
        for, make it readable: it is dropped, as redis-py drops such a connection), else a new one."""
        while True:
            with self._lock:
                sock = self._idle.pop() if self._idle else None
            if sock is None:
                return self._open()
            if not select.select([sock], [], [], 0)[0]:
                return sock
            sock.close()

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE:
                self._idle.append(sock)
                return
        sock.close()

    def _open(self) -> socket.socket:
        k = self._kwargs
        timeout = k.get("socket_timeout")
        try:
            if k.get("path"):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(k.get("socket_connect_timeout") or timeout)
                sock.connect(k["path"])
            else:
                sock = socket.create_connection(
                    (k["host"], k["port"]), k.get("socket_connect_timeout") or timeout
                )
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except TimeoutError:
            raise redis.exceptions.TimeoutError("Timeout connecting to server") from None
        except OSError as e:
            raise redis.exceptions.ConnectionError(f"Error connecting to {self._where()}: {e}") from None
        sock.settimeout(timeout)
        try:
            self._handshake(sock)
        except BaseException:
            sock.close()
            raise
        return sock

    def _handshake(self, sock: socket.socket) -> None:
        """``AUTH`` and ``SELECT`` as the URL asks; an error reply is raised as redis-py raises it."""
        k, hello = self._kwargs, []
        if k.get("password") is not None:
            user = (k["username"],) if k.get("username") else ()
            hello.append(Command(("AUTH", *user, k["password"])))
        if k.get("db"):
            hello.append(Command(("SELECT", k["db"])))
        if not hello:
            return
        sock.sendall(pack(hello))
        for reply in receive(sock, hello):
            if isinstance(reply, Exception):
                raise reply

    def _where(self) -> str:
        k = self._kwargs
        return k["path"] if k.get("path") else f"{k.get('host')}:{k.get('port')}"

    def close(self) -> None:
        """Close the idle sockets; a read in flight closes its own when done."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            idle += list(self._aheads)
            self._aheads.clear()
        for sock in idle:
            sock.close()

"""A minimal RESP2 client: enough to read back what LMCache stored in Redis (binary-safe, no dependency)."""

from __future__ import annotations

import socket

__all__ = ["RespClient", "RespError"]


class RespError(RuntimeError):
    """An error reply from the server."""


class RespClient:
    """One connection to one Redis node; ``call(*args)`` sends a command and returns its decoded reply."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout)
        self._buf = self._sock.makefile("rb")

    def call(self, *args: str | bytes | int) -> object:
        parts = [a if isinstance(a, bytes) else str(a).encode() for a in args]
        msg = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
        self._sock.sendall(msg)
        return self._reply()

    def _reply(self) -> object:
        line = self._buf.readline()
        if not line.endswith(b"\r\n"):
            raise ConnectionError(f"connection closed mid-reply: {line!r}")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RespError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self._buf.read(n + 2)[:-2]
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._reply() for _ in range(n)]
        raise ConnectionError(f"unexpected RESP reply {line!r}")

    def keys(self) -> list[bytes]:
        """Every key on this node (SCAN, so a big node is not blocked)."""
        cursor, out = b"0", []
        while True:
            cursor, batch = self.call("SCAN", cursor, "COUNT", 1000)
            out.extend(batch)
            if cursor == b"0":
                return out

    def info(self, section: str) -> dict[str, str]:
        text = self.call("INFO", section).decode()
        return dict(
            line.split(":", 1) for line in text.splitlines() if ":" in line and not line.startswith("#")
        )

    def close(self) -> None:
        self._buf.close()
        self._sock.close()

    def __enter__(self) -> RespClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

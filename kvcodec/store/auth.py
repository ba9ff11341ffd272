"""The fleet MAC: blobs in a shared store that only holders of the fleet key can have written.

A CRC catches damage, not a forger: anyone who can write to a shared Redis can
store a well-formed blob (right model identity, right prefix hash, a valid CRC)
under any key. With a fleet key, every value a host writes is the blob in a
small envelope carrying an HMAC-SHA256 over the value's name and the blob, and
readers check it before they parse anything:

=======  ========  ====================================================================
offset   length    field
=======  ========  ====================================================================
0        8         ``ENVELOPE_MAGIC`` (``b"KVCMAC\\x01\\x00"``: envelope version 1)
8        32        HMAC-SHA256(fleet key, ``b"kvcodec.fleet.mac.v1\\x00"`` ‖ u32 LE length
                   of the name ‖ the name (UTF-8) ‖ the blob)
40       rest      the LMCKV blob, as given to ``put``
=======  ========  ====================================================================

The name is the value's full name in the store (key prefix, hash tag and key),
so a valid blob copied under another key, another chunk or another model's
prefix fails the check too. What a MAC does not stop (replaying an old valid
value under its own name) is in docs/fleet.md.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

from ..errors import CorruptEncodedKVError, Reason, UnsupportedConfigError

__all__ = [
    "ENVELOPE_LEN",
    "ENVELOPE_MAGIC",
    "MIN_KEY_BYTES",
    "load_fleet_key",
    "open_envelope",
    "seal",
    "strip_envelope",
]

ENVELOPE_MAGIC = b"KVCMAC\x01\x00"
"""The first 8 bytes of a sealed value (never the start of an LMCKV blob, whose magic is ``LMCKV``)."""

_MAC_LEN = hashlib.sha256().digest_size
ENVELOPE_LEN = len(ENVELOPE_MAGIC) + _MAC_LEN
"""Bytes the envelope adds in front of the blob (40)."""

MIN_KEY_BYTES = 16
"""Shortest fleet key accepted: a key anyone can guess authenticates nothing."""

_DOMAIN = b"kvcodec.fleet.mac.v1\x00"
_NAME_LEN = struct.Struct("<I")


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) < MIN_KEY_BYTES:
        n = len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise UnsupportedConfigError(
            f"fleet key must be at least {MIN_KEY_BYTES} bytes, got {n}", reason=Reason.BAD_VALUE
        )
    return bytes(key)


def _mac(key: bytes, name: str, blob: memoryview) -> bytes:
    encoded = name.encode()
    h = hmac.new(key, _DOMAIN, hashlib.sha256)
    h.update(_NAME_LEN.pack(len(encoded)))
    h.update(encoded)
    h.update(blob)
    return h.digest()


def seal(key: bytes, name: str, blob: bytes | bytearray | memoryview) -> bytes:
    """``blob`` in its envelope: the value a host with ``key`` stores under ``name``."""
    mv = memoryview(blob).cast("B")
    return b"".join((ENVELOPE_MAGIC, _mac(_check_key(key), name, mv), mv))


def open_envelope(key: bytes, name: str, value: bytes | memoryview) -> memoryview:
    """The blob inside ``value`` (a view, no copy) if its MAC is valid for ``name`` under ``key``.

    Raises :class:`CorruptEncodedKVError` with ``reason=BAD_MAC`` for a value
    without an envelope, a truncated one, or a MAC that does not match.
    """
    mv = memoryview(value).cast("B")
    if len(mv) < ENVELOPE_LEN or mv[: len(ENVELOPE_MAGIC)] != ENVELOPE_MAGIC:
        raise CorruptEncodedKVError(f"{name!r} carries no fleet MAC", reason=Reason.BAD_MAC)
    blob = mv[ENVELOPE_LEN:]
    if not hmac.compare_digest(mv[len(ENVELOPE_MAGIC) : ENVELOPE_LEN], _mac(_check_key(key), name, blob)):
        raise CorruptEncodedKVError(
            f"{name!r} has a fleet MAC that does not match: written without the fleet key",
            reason=Reason.BAD_MAC,
        )
    return blob


def strip_envelope(value: bytes | memoryview) -> memoryview:
    """The blob of a value read without a fleet key: an envelope's MAC is skipped, unchecked
    (a reader without the key trusts the store); a bare blob is returned as it is."""
    mv = memoryview(value).cast("B")
    if len(mv) >= ENVELOPE_LEN and mv[: len(ENVELOPE_MAGIC)] == ENVELOPE_MAGIC:
        return mv[ENVELOPE_LEN:]
    return mv


def load_fleet_key(
    env: str | None = "KVCODEC_FLEET_KEY", path: str | os.PathLike[str] | None = None
) -> bytes | None:
    """The fleet key: the file at ``path`` if given (trailing newline dropped), else the environment
    variable ``env``; None when neither is set or both are empty (no MAC)."""
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = f.read().rstrip(b"\r\n")
        except OSError as e:
            raise UnsupportedConfigError(
                f"fleet key file {os.fspath(path)!r} cannot be read: {e.strerror}", reason=Reason.BAD_VALUE
            ) from None
    else:
        raw = os.environ.get(env, "").encode() if env else b""
    return _check_key(raw) if raw else None

"""Store key rules: what may name a blob, and the stable per-model key of ``DirectoryStore.make_key``.

Keys become file names (and Redis keys), so they are short, ASCII and never
start with a dot (dot names are a directory store's own: temp files and the
quarantine folder). The store never reads meaning out of a key; grouping for
eviction is the caller's ``group_of``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

from ..errors import Reason, UnsupportedConfigError
from ..format import HASH_KEYS, Hashes

__all__ = ["MAX_KEY_LEN", "InvalidKeyError", "is_key_name", "model_key", "validate_key"]

MAX_KEY_LEN = 200
"""Longest key, so that key-derived file names stay under NAME_MAX (255)."""

_KEY_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
_KEY_DOMAIN = b"kvcodec.store.key.v1\x00"


class InvalidKeyError(UnsupportedConfigError, ValueError):
    """A key that cannot name a store file (empty, too long, unsafe characters, leading dot)."""

    default_reason = Reason.BAD_KEY


def is_key_name(name: str) -> bool:
    """Whether a directory entry's name could be a key (dot names and odd names are not blobs)."""
    return len(name) <= MAX_KEY_LEN and _KEY_RE.fullmatch(name) is not None


def validate_key(key: Any) -> str:
    """Return ``key`` if it is a safe store key, else raise :class:`InvalidKeyError`.

    Keys become file names, so they are 1..200 characters of ``[A-Za-z0-9._-]``
    and may not start with a dot (dot names are the store's own: temp files and
    the quarantine directory).
    """
    if not isinstance(key, str):
        raise InvalidKeyError(f"store key must be a str, got {type(key).__name__}", reason=Reason.BAD_KEY)
    if not key:
        raise InvalidKeyError("store key is empty", reason=Reason.BAD_KEY)
    if len(key) > MAX_KEY_LEN:
        raise InvalidKeyError(
            f"store key is {len(key)} characters; at most {MAX_KEY_LEN}", reason=Reason.BAD_KEY
        )
    if not _KEY_RE.fullmatch(key):
        raise InvalidKeyError(
            f"store key {key!r} must use only [A-Za-z0-9._-] and must not start with '.'",
            reason=Reason.BAD_KEY,
        )
    return key


def model_key(
    hashes: Hashes | Mapping[str, str | None], layer_id: int, chunk_id: int, *, chunk_hash: str = ""
) -> str:
    """Stable key ``"<model16>-L<layer>-C<chunk>[-H<chunk_hash>]"``.

    ``model16`` is the first 16 hex digits of SHA-256 over a domain tag and
    the six identity strings (in :data:`~kvcodec.format.HASH_KEYS` order,
    each UTF-8 with a 4-byte big-endian length prefix), so blobs of
    different models, tokenizers or layouts never share a key.
    """
    h = Hashes.coerce(hashes)
    for name, val in (("layer_id", layer_id), ("chunk_id", chunk_id)):
        if isinstance(val, bool) or not isinstance(val, int):
            raise UnsupportedConfigError(f"{name} must be an int >= 0, got {val!r}", reason=Reason.BAD_TYPE)
        if val < 0:
            raise UnsupportedConfigError(f"{name} must be an int >= 0, got {val!r}", reason=Reason.BAD_VALUE)
    md = hashlib.sha256(_KEY_DOMAIN)
    for k in HASH_KEYS:
        raw = getattr(h, k).encode("utf-8")
        md.update(len(raw).to_bytes(4, "big"))
        md.update(raw)
    key = f"{md.hexdigest()[:16]}-L{layer_id}-C{chunk_id}"
    if chunk_hash != "":
        key += f"-H{chunk_hash}"
    return validate_key(key)

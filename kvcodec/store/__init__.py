"""Blob stores: where the connectors keep LMCKV blobs, behind one interface.

:class:`BlobStore` (``base.py``) is the interface and its semantics (what is
atomic, what a miss and a damaged blob look like); :func:`open_store` picks a
backend from a path or URL. :class:`DirectoryStore` is the embedded default
(one file per key; ``directory.py`` composes key rules, file primitives, the
size index, the eviction policy and quarantine); the Redis backend lives in
``kvcodec.store.redis`` and is imported only when a ``redis://`` URL is opened.
"""

from __future__ import annotations

from .base import STORE_COUNTERS, BlobStore, GroupOf, StoreFullError, StoreOptions
from .directory import (
    MAX_KEY_LEN,
    QUARANTINE_DIRNAME,
    DirectoryStore,
    InvalidKeyError,
    chunk_group,
    validate_key,
)
from .factory import open_store

__all__ = [
    "MAX_KEY_LEN",
    "QUARANTINE_DIRNAME",
    "STORE_COUNTERS",
    "BlobStore",
    "DirectoryStore",
    "GroupOf",
    "InvalidKeyError",
    "StoreFullError",
    "StoreOptions",
    "chunk_group",
    "open_store",
    "validate_key",
]

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
from .directory import DirectoryStore
from .eviction import EvictionPolicy, GroupLRU
from .factory import open_store
from .keys import MAX_KEY_LEN, InvalidKeyError, validate_key
from .quarantine import QUARANTINE_DIRNAME

__all__ = [
    "MAX_KEY_LEN",
    "QUARANTINE_DIRNAME",
    "STORE_COUNTERS",
    "BlobStore",
    "DirectoryStore",
    "EvictionPolicy",
    "GroupLRU",
    "GroupOf",
    "InvalidKeyError",
    "StoreFullError",
    "StoreOptions",
    "open_store",
    "validate_key",
]

"""Blob stores: where the connectors keep LMCKV blobs, behind one interface.

* ``base.py``: :class:`BlobStore` (the interface and its semantics: what is
  atomic, what a miss and a damaged blob look like), :class:`StoreOptions`,
  :data:`STORE_COUNTERS`, :class:`StoreFullError`;
* ``factory.py``: :func:`open_store` picks a backend from a path or URL;
* ``directory.py``: :class:`DirectoryStore`, the embedded default (one file per
  key), composing ``keys.py`` (key rules), ``files.py`` (POSIX primitives),
  ``reading.py`` (reads bounded by the sizes a header declares), ``index.py``
  (sizes and recency), ``eviction.py`` (:class:`GroupLRU`, configured with the
  caller's ``group_of``) and ``evictor.py``, ``quarantine.py``, ``recovery.py``
  (dead writers' temp files) and ``counters.py`` (``stats()``);
* ``redis.py``: the Redis / Redis Cluster backend, imported only when a
  ``redis://`` URL is opened.
"""

from __future__ import annotations

from .base import STORE_COUNTERS, BlobStore, GroupOf, GroupRead, StoreFullError, StoreOptions
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
    "GroupRead",
    "InvalidKeyError",
    "StoreFullError",
    "StoreOptions",
    "open_store",
    "validate_key",
]

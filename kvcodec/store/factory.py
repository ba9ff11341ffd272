"""``open_store``: a store from a path or a URL, the one place that picks a backend."""

from __future__ import annotations

import os
from importlib import import_module
from urllib.parse import urlsplit

from ..errors import Reason, UnsupportedConfigError
from .base import BlobStore, StoreOptions

__all__ = ["REDIS_SCHEMES", "open_store"]

REDIS_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
"""URL schemes served by :class:`kvcodec.store.redis.RedisStore` (imported only when one is used)."""


def open_store(spec: str | os.PathLike[str], options: StoreOptions | None = None) -> BlobStore:
    """The store ``spec`` names: a path or ``file://`` URL -> DirectoryStore; ``redis://``,
    ``rediss://``, ``redis+cluster://``, ``rediss+cluster://`` -> RedisStore."""
    opts = options if options is not None else StoreOptions()
    if not isinstance(opts, StoreOptions):
        raise UnsupportedConfigError(
            f"options must be a StoreOptions, got {type(opts).__name__}", reason=Reason.BAD_TYPE
        )
    if isinstance(spec, os.PathLike):
        return _directory(os.fspath(spec), opts)
    if not isinstance(spec, str) or not spec:
        raise UnsupportedConfigError(f"store must be a path or a URL, got {spec!r}", reason=Reason.BAD_VALUE)
    scheme = urlsplit(spec).scheme.lower() if "://" in spec else ""
    if scheme in REDIS_SCHEMES:
        redis_mod = import_module(".redis", __package__)  # lazily: a redis client only when asked
        return redis_mod.RedisStore.from_url(spec, opts)
    if scheme == "file":
        parts = urlsplit(spec)
        if parts.netloc not in ("", "localhost"):
            raise UnsupportedConfigError(
                f"file:// store on host {parts.hostname or '***'!r}: only local paths",
                reason=Reason.BAD_VALUE,
            )
        return _directory(parts.path, opts)
    if scheme:
        raise UnsupportedConfigError(
            f"unknown store scheme {scheme!r} (the URL is not shown: it may hold a password); "
            "expected a path, file://, " + ", ".join(f"{s}://" for s in REDIS_SCHEMES),
            reason=Reason.BAD_VALUE,
        )
    return _directory(spec, opts)


def _directory(path: str, opts: StoreOptions) -> BlobStore:
    from .directory import DirectoryStore

    return DirectoryStore.from_options(path, opts)

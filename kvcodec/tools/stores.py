"""Blob stores named by URL on the command line (``verify`` and ``inspect`` of ``redis://...``).

A store is opened with :func:`kvcodec.store.open_store` and walked with its
``iter_keys()`` (SCAN on Redis), one blob in memory at a time, so a store of
any size costs what its largest blob does. Blobs are read through the store's
own ``get``: its checks run as on a load (size against the header, the fleet
MAC when a key is given), and a blob they refuse is removed by the store, as
a load would remove it, and reported here as bad.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .common import CLIError, escape_text, positive

__all__ = ["STORE_SCHEMES", "StoreBlob", "add_store_args", "is_store_url", "location_of", "store_blobs"]

STORE_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
"""URL schemes read as stores (``kvcodec.store.factory.REDIS_SCHEMES``; a test keeps them equal)."""


def is_store_url(text: str) -> bool:
    """Whether a command-line argument names a store by URL rather than a file or folder."""
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.lower() in STORE_SCHEMES


def add_store_args(p: argparse.ArgumentParser) -> None:
    """Options for arguments that are store URLs."""
    g = p.add_argument_group("stores (arguments redis://, rediss://, redis+cluster://...)")
    g.add_argument("--key-prefix", metavar="PREFIX", help="the store's key prefix (default: the backend's)")
    g.add_argument(
        "--fleet-key-env",
        default="KVCODEC_FLEET_KEY",
        metavar="VAR",
        help="environment variable holding the fleet MAC key (unset or empty: MACs are not checked)",
    )
    g.add_argument(
        "--store-timeout-ms", type=positive, default=2000, metavar="MS", help="per-call store timeout"
    )


@dataclass(frozen=True)
class StoreBlob:
    """One key of a store: its display name and either its blob or why it could not be read."""

    name: str
    blob: memoryview | None
    error: str | None = None


def _open(url: str, args: argparse.Namespace, verify_crc: bool) -> Any:
    from ..errors import CodecError
    from ..store import StoreOptions, open_store
    from ..store.auth import load_fleet_key

    env = getattr(args, "fleet_key_env", None)
    options = StoreOptions(
        key_prefix=getattr(args, "key_prefix", None),
        fleet_key=load_fleet_key(env) if env else None,
        timeout_s=getattr(args, "store_timeout_ms", 2000) / 1000,
        verify_blobs=verify_crc,
    )
    try:
        return open_store(url, options)
    except CodecError as e:
        raise CLIError(f"{escape_text(location_of(url))}: {e}") from None


def store_blobs(
    url: str, args: argparse.Namespace, *, pattern: str = "*", verify_crc: bool = True
) -> Iterator[StoreBlob]:
    """Each key of the store at ``url`` matching ``pattern``, with its blob (or the store's refusal).

    A store that cannot be reached ends the walk with a CLIError; a key removed
    during the walk is skipped.
    """
    from ..errors import CodecError, StoreUnavailableError

    store = _open(url, args, verify_crc)
    try:
        for key in store.iter_keys():
            if not fnmatch.fnmatchcase(key, pattern):
                continue
            name = f"{store.location}/{key}"
            try:
                yield StoreBlob(name, store.get(key))
            except KeyError:
                continue  # removed (or evicted) since the scan listed it
            except StoreUnavailableError:
                raise
            except CodecError as e:
                yield StoreBlob(name, None, f"{type(e).__name__}: {e}")
    except StoreUnavailableError as e:
        raise CLIError(f"{escape_text(store.location)}: {e}") from None
    finally:
        store.close()


def location_of(url: str) -> str:
    """``url`` for messages (never a password: only what follows an ``@``, if any)."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2]}" if rest else os.fspath(url)

"""Blob stores named by URL on the command line (``verify`` and ``inspect`` of ``redis://...``).

A store is opened with :func:`kvcodec.store.open_store` and walked with its
``iter_names()`` (SCAN on Redis), one blob in memory at a time, so a store of
any size costs what its largest blob does. Each value is read under the name it
is stored under (the connector's keys carry their chunk's hash tag, which only
its ``group_of`` knows), through the store's own checks, as on a load (size
against the header, the fleet MAC when a key is given): a value they refuse (a
damaged blob, a key of another Redis type) is removed by the store, as a load
would remove it, and reported here as bad. URLs are shown without credentials,
in every message.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .common import EXIT_USAGE, CLIError, escape_text, positive

__all__ = [
    "MAX_STORE_TIMEOUT_MS",
    "STORE_SCHEMES",
    "StoreBlob",
    "add_store_args",
    "check_urls",
    "is_store_url",
    "location_of",
    "store_blobs",
    "store_timeout_ms",
]

STORE_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
"""URL schemes read as stores (``kvcodec.store.factory.REDIS_SCHEMES``; a test keeps them equal)."""
MAX_STORE_TIMEOUT_MS = 3_600_000
"""The longest ``--store-timeout-ms`` (``kvcodec.store.redis.MAX_TIMEOUT_S``; a test keeps them equal)."""
_PORT = re.compile(r"\[?[^\s\[\]/@?]+\]?:\d{1,5}")


def store_timeout_ms(text: str) -> int:
    """``--store-timeout-ms``: an integer in 1..MAX_STORE_TIMEOUT_MS."""
    n = positive(text)
    if n > MAX_STORE_TIMEOUT_MS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_STORE_TIMEOUT_MS} ms (an hour), got {n}")
    return n


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
        "--store-timeout-ms",
        type=store_timeout_ms,
        default=2000,
        metavar="MS",
        help=f"per-call store timeout (1..{MAX_STORE_TIMEOUT_MS})",
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
    """Each value of the store at ``url`` whose key matches ``pattern``, with its blob (or the store's
    refusal), read under the name it is stored under.

    A store that cannot be reached ends the walk with a CLIError; a key removed
    during the walk is skipped.
    """
    from ..errors import CodecError, StoreUnavailableError

    store = _open(url, args, verify_crc)
    try:
        for key, name in store.iter_names():
            if not fnmatch.fnmatchcase(key, pattern):
                continue
            shown = f"{store.location}/{key}"
            try:
                yield StoreBlob(shown, store.get_named(name))
            except KeyError:
                continue  # removed (or evicted) since the scan listed it
            except StoreUnavailableError:
                raise
            except CodecError as e:
                yield StoreBlob(shown, None, f"{type(e).__name__}: {e}")
    except StoreUnavailableError as e:
        raise CLIError(f"{escape_text(store.location)}: {e}") from None
    finally:
        store.close()


def location_of(url: str) -> str:
    """``url`` for messages, never a password: the scheme, then the hosts only when each is
    ``host:port`` (text before an ``@`` is credentials; a password whose ``@host`` was left out is
    no ``host:port``), else ``***``; the database and options are not shown."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return os.fspath(url)
    hosts = re.split(r"[/?]", rest.rpartition("@")[2], maxsplit=1)[0]
    shown = hosts if hosts and all(_PORT.fullmatch(h) for h in hosts.split(",")) else "***"
    return f"{scheme}://{shown}"


def check_urls(args: Sequence[str]) -> None:
    """Refuse an argument that is a URL of a scheme no store serves (it is no file either), showing it
    without credentials: a usage error."""
    for text in args:
        if "://" in text and not is_store_url(text):
            raise CLIError(
                f"{escape_text(location_of(text))}: not a file, and no store URL "
                f"(schemes: {', '.join(s + '://' for s in STORE_SCHEMES)})",
                EXIT_USAGE,
            )

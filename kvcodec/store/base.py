"""The blob store interface every backend implements: what the vLLM connector may use, nothing else.

A store maps keys (see :func:`kvcodec.store.validate_key`) to LMCKV blobs. It
never encodes: it keeps the bytes it is given and hands back verified blobs.

* **Atomic writes.** ``put`` makes the whole new blob visible at once: a reader
  (another thread, process or engine) sees the old blob, the new one, or a miss,
  never a mix. ``put_many`` is ``put`` per item, in order (one round trip on a
  remote backend); it is not a transaction across items.
* **A miss** is ``KeyError(key)`` from ``get``/``get_parsed``/``get_parsed_many``
  and ``False`` from ``contains``/``contains_many``/``delete``. A key a backend
  cannot name raises :class:`~kvcodec.store.InvalidKeyError` (reason ``BAD_KEY``).
* **A damaged blob** (bad CRC, truncated, a size that is not header + payload,
  a missing or wrong MAC) raises :class:`~kvcodec.errors.CorruptEncodedKVError`
  with the specific reason of the check that failed (``CRC_MISMATCH``,
  ``TRUNCATED_PAYLOAD``, ``SIZE_MISMATCH``, ``BAD_MAC``, ...), after the backend
  has removed or quarantined it: the next read of that key is a miss.
* **Bounded reads.** ``get``, ``get_parsed`` and ``get_parsed_many`` take
  ``max_bytes``, the largest blob (header + payload) the caller expects: a
  stored value longer than that is damage, refused before more than that is
  read or held (a store's own envelope, the fleet MAC's 40 bytes, comes on top).
* **An outage** raises :class:`~kvcodec.errors.StoreUnavailableError` (reasons
  ``STORE_UNAVAILABLE`` / ``STORE_TIMEOUT``) from any call; the backend logs
  one WARNING per outage, one INFO when it is back, and recovers by itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..errors import Reason, UnsupportedConfigError
from ..format import ParsedBlob

__all__ = [
    "SEALS_VALUES",
    "STORE_COUNTERS",
    "BlobStore",
    "GroupOf",
    "GroupRead",
    "ReadBufferPool",
    "StoreFullError",
    "StoreOptions",
    "check_max_bytes",
]

STORE_COUNTERS: tuple[str, ...] = (
    "round_trips",
    "hits",
    "misses",
    "bytes_read",
    "bytes_written",
    "timeouts",
    "errors",
)
"""The keys of :meth:`BlobStore.stats`, in order; each a cumulative count since the store was opened."""

GroupOf = Callable[[str], tuple[str, int, str | None]]
"""``key -> (group id, depth, parent group id)``: how a store's eviction groups keys
(:func:`kvcodec.integrations.vllm.chunk_keys.group_of` for the connector's keys)."""


@dataclass(frozen=True)
class GroupRead:
    """One ``get_parsed_many`` a reader is about to make: its keys and ``max_bytes``, exactly."""

    keys: tuple[str, ...]
    max_bytes: int | None = None


@runtime_checkable
class ReadBufferPool(Protocol):
    """Where a read takes the buffer its bytes go into (the connector's pool of buffers given back
    once their chunk is written): reused memory costs no page faults."""

    def lend(self, at_least: int) -> bytearray:
        """A buffer of at least ``at_least`` bytes: an idle one, else a new one of the pool's own."""
        ...

    def owns(self, buf: object) -> bool:
        """Whether ``buf`` was lent by this pool (the caller gives it back once done with it)."""
        ...

    def give(self, buffers: list[bytearray]) -> None:
        """Take back buffers no blob views any more (a reader done with them, or a store that read into
        them and handed out blobs elsewhere)."""
        ...


class StoreFullError(UnsupportedConfigError):
    """``put`` found no room under ``max_bytes`` without evicting the new key's own chunk prefix."""

    default_reason = Reason.STORE_FULL


@dataclass(frozen=True)
class StoreOptions:
    """How to open a store (:func:`kvcodec.store.open_store`); a backend ignores what it has no use for.

    ``max_bytes``: size cap (None: unbounded, or the server's own policy).
    ``fsync``: make each put durable across power loss (DirectoryStore).
    ``group_of``: how eviction groups keys; None makes every key its own group (plain LRU).
    ``key_prefix``: namespace of a shared server (None: the backend's default).
    ``fleet_key``: MAC key of a fleet sharing one server (None: no MAC).
    ``timeout_s``: per-call timeout of a remote backend.
    ``verify_blobs``: check a blob's CRC on ``get`` (``get_parsed`` always does).
    ``evict_first``: keys an eviction removes before the rest of their group (the connector's
    manifests, so that no lookup finds a manifest whose blobs are going); None: key order.
    """

    max_bytes: int | None = None
    fsync: bool = False
    group_of: GroupOf | None = None
    key_prefix: str | None = None
    fleet_key: bytes | None = None
    timeout_s: float = 0.05
    verify_blobs: bool = True
    evict_first: Callable[[str], bool] | None = None


SEALS_VALUES = "seals_values"
"""An optional store attribute: True on a store that seals each value with the fleet key's MAC and
checks it on read (a shared remote store); absent or False on a local one (a directory, RAM)."""


@runtime_checkable
class BlobStore(Protocol):
    """Key -> LMCKV blob storage, as the connector uses it (see the module docstring for the semantics)."""

    partial_groups: bool
    """True when one blob of a chunk group can vanish on its own (a remote LRU): a lookup must then
    check every key of a chunk, not only its manifest. False when eviction removes whole groups."""

    location: str
    """Where the blobs live, for logs (a path or a URL without its password)."""

    def put(self, key: str, blob: Any) -> None:
        """Store ``blob`` (bytes-like) under ``key``, atomically; may raise StoreFullError."""
        ...

    def put_many(self, items: Sequence[tuple[str, Any]]) -> None:
        """``put`` each ``(key, blob)`` in order; each item atomic on its own."""
        ...

    def get(self, key: str, *, max_bytes: int | None = None) -> memoryview:
        """The verified blob under ``key``; KeyError on a miss; a value over ``max_bytes`` is damage."""
        ...

    def get_parsed(
        self,
        key: str,
        into: bytearray | None = None,
        *,
        verify_crc: bool = True,
        max_bytes: int | None = None,
    ) -> ParsedBlob:
        """The blob under ``key`` read once and parsed once, CRC checked; ``into`` may hold its bytes.

        ``verify_crc=False`` (optional: a backend may ignore it and check anyway) leaves the CRC to
        the caller, who checks it in its own pass and must then treat a mismatch as damage.
        ``max_bytes``: the largest blob the caller expects (None: the backend's own limit)."""
        ...

    def get_parsed_many(
        self,
        keys: Sequence[str],
        *,
        verify_crc: bool = True,
        max_bytes: int | None = None,
        buffers: ReadBufferPool | None = None,
    ) -> list[ParsedBlob]:
        """``get_parsed`` of each key, all or nothing: KeyError(key) if any one is missing.

        ``buffers``: a store that reads into buffers of its own may borrow them there (optional); a
        blob whose buffer (``blob.buffer.obj``) the pool :meth:`~ReadBufferPool.owns` is the caller's
        to give back once done with it."""
        ...

    def read_ahead(self, reads: Sequence[GroupRead]) -> None:
        """A hint: this thread's next ``get_parsed_many`` calls are ``reads``, in order. A remote store
        may ask for them now, so the server prepares one while the caller checks the one before; a
        read that differs drops the hint. Empty ``reads``: the caller is done (drop what is left).
        Never raises for the hint's sake; a local store ignores it."""
        ...

    def contains(self, key: str) -> bool:
        """Whether a blob is stored under ``key`` (not verified: a read may still find it damaged)."""
        ...

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """``contains`` of each key, in order."""
        ...

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if a blob was removed."""
        ...

    def keys(self) -> list[str]:
        """Every key stored, sorted."""
        ...

    def iter_keys(self) -> Iterator[str]:
        """Every key stored, in no set order, holding a bounded number in memory at a time."""
        ...

    def stats(self) -> dict[str, float]:
        """Cumulative counters, exactly the keys of :data:`STORE_COUNTERS`."""
        ...

    def close(self) -> None:
        """Release the store's resources; later calls raise."""
        ...


def check_max_bytes(max_bytes: Any) -> None:
    """Refuse a ``max_bytes`` that is neither None nor a positive int."""
    if max_bytes is None:
        return
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
        raise UnsupportedConfigError(
            f"max_bytes must be an int or None, got {max_bytes!r}", reason=Reason.BAD_TYPE
        )
    if max_bytes <= 0:
        raise UnsupportedConfigError(f"max_bytes must be positive, got {max_bytes}", reason=Reason.BAD_VALUE)

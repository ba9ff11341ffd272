"""Values sized to Redis's allocator: a large value stored as a head of exactly one size class and a tail.

Redis (jemalloc, as Debian and the upstream build ship it) rounds every allocation up to a size
class, four per doubling (..., 768 KiB, 896 KiB, 1 MiB, ...), and a string value of ``n`` bytes
(64 KiB and more: a 9-byte SDS header and its NUL) takes ``n + 10`` of them. An LMCKV blob of a
power-of-two cache is 0.75x of it plus a header and scales: just over a class (the Llama-3-8B layer
blob, 787,290 bytes, is 858 over 768 KiB and takes 896 KiB). So a value whose class wastes more than
a small key costs is stored in two keys of one hash slot, written together by one ``MSET`` (atomic):

=========  ==============================================================================
name       value
=========  ==============================================================================
``NAME``   the MAC envelope (40, with a fleet key) ‖ ``SPLIT_MAGIC`` (8) ‖ write id (8, random) ‖
           u32 LE tail length ‖ the blob's first bytes: exactly ``class - 10`` bytes in all
``TAIL``   the write id (8) ‖ the value's other bytes (at most a quarter of the value)
=========  ==============================================================================

The value split is the one a whole key would hold (the fleet MAC's envelope and the blob, the MAC
over the whole blob and ``NAME``), its frame put after the envelope (a sealed value still starts
with it), so every check after :func:`join` is the whole value's. A tail's
name (:func:`tail_name`) is never a key, and listings skip it. A reader fetches both parts in
the same pipeline, each bounded (:class:`Limits`); a tail of another write id (a read between two
writes) is read again, a missing tail (evicted alone) is a miss.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptEncodedKVError, Reason
from .auth import ENVELOPE_LEN, ENVELOPE_MAGIC
from .redis_wire import Command, Part

__all__ = [
    "FRAME_LEN",
    "KEY_COST",
    "PEEK_LEN",
    "SDS_LARGE",
    "SPLIT_MAGIC",
    "TAIL_FRAME_LEN",
    "TAIL_MARK",
    "TORN",
    "Assemble",
    "Limits",
    "PartDamage",
    "concat",
    "head_len",
    "in_place",
    "is_split",
    "join",
    "peek_commands",
    "read_commands",
    "read_value",
    "size_class",
    "split",
    "tail_name",
]

SPLIT_MAGIC = b"KVCSPL\x01\x00"
"""The first 8 bytes of a split value's head (an LMCKV blob starts ``LMCKV``, a MAC envelope ``KVCMAC``)."""
_FRAME = struct.Struct("<8s8sI")
FRAME_LEN = _FRAME.size
"""The head's frame: magic, write id, the tail's length (20 bytes)."""
PEEK_LEN = ENVELOPE_LEN + FRAME_LEN
"""The first bytes of a value that tell whether it is split (a MAC envelope, then the frame)."""
TAIL_FRAME_LEN = 8
"""The tail's frame: the write id."""
TAIL_MARK = "~t"
"""A tail's name is its head's with this after the key prefix (``kvcodec~t:{C0-H..}:<key>``): the
same hash tag (slot), outside the prefix's ``<prefix>:{`` names (``~`` is in no prefix or key)."""

SDS_LARGE = 10
"""Bytes Redis allocates beyond a string value of 64 KiB or more (SDS header 9, NUL 1); measured."""
SDS_SMALL = 6
"""At most, for a shorter one (SDS header 3 or 5, NUL 1)."""
KEY_COST = 160
"""What one more key costs Redis beyond its value (dict entry, object, a ~110-byte name): measured
152 with ``MEMORY USAGE`` on Redis 7.0 for the connector's names."""
_MIN_HEAD_CLASS = 80 << 10
"""Smallest head class: a head of at least 64 KiB has the large SDS header."""


def size_class(n: int) -> int:
    """jemalloc's size class for ``n`` bytes (n >= 1): 8, 16, then four classes per doubling."""
    if n <= 16:
        return 8 if n <= 8 else 16
    lg = (n - 1).bit_length() - 1  # 2**lg < n <= 2**(lg + 1)
    step = max(16, 1 << (lg - 2))
    return -(-n // step) * step


def _class_at_most(n: int) -> int:
    """The largest size class of at most ``n`` bytes (n >= 32)."""
    up = size_class(n)
    if up == n:
        return n
    lg = (n - 1).bit_length() - 1
    return up - max(16, 1 << (lg - 2))


def head_len(n: int) -> int | None:
    """How many of a value's ``n`` bytes its head holds, or None: the value is stored whole (it fits
    its class closely, or it is small, or a tail would cost more than the class wastes)."""
    whole = size_class(n + SDS_LARGE)
    head_class = _class_at_most(n + SDS_LARGE + FRAME_LEN)
    if head_class < _MIN_HEAD_CLASS:
        return None
    held = head_class - SDS_LARGE - FRAME_LEN
    tail = n - held
    if tail <= 0 or tail > n // 4:
        return None
    split_cost = head_class + size_class(TAIL_FRAME_LEN + tail + SDS_SMALL) + KEY_COST
    return held if split_cost < whole else None


def is_split(head: Any) -> bool:
    """Whether a value's first :data:`PEEK_LEN` bytes as read (bytes, or ``WRONGTYPE``'s error: no)
    are those of a split value's head."""
    if not isinstance(head, bytes):
        return False
    at = _envelope_len(head)
    return head[at : at + len(SPLIT_MAGIC)] == SPLIT_MAGIC


def tail_name(name: str) -> str:
    """The name of the tail of the value named ``name`` (``<prefix>:{<group>}:<key>``)."""
    at = name.find(":{")
    return f"{name[:at]}{TAIL_MARK}{name[at:]}" if at >= 0 else f"{TAIL_MARK}{name}"


def split(value: Any) -> tuple[Any, bytes | None]:
    """``(head, tail)`` of a value (bytes-like) as stored; ``tail`` None: stored whole as ``value``."""
    mv = memoryview(value).cast("B")
    held = head_len(len(mv))
    if held is None:
        return value, None
    write_id = os.urandom(TAIL_FRAME_LEN)
    at = _envelope_len(mv)  # the frame goes after a MAC envelope: a sealed value starts with it
    head = b"".join((mv[:at], _FRAME.pack(SPLIT_MAGIC, write_id, len(mv) - held), mv[at:held]))
    return head, b"".join((write_id, mv[held:]))


def _envelope_len(value: Any) -> int:
    """``ENVELOPE_LEN`` when ``value`` (a whole value or a head) starts with a MAC envelope, else 0."""
    return ENVELOPE_LEN if value[: len(ENVELOPE_MAGIC)] == ENVELOPE_MAGIC else 0


@dataclass(frozen=True)
class Limits:
    """The most bytes a read takes of each part (``GETRANGE 0 <limit>``, the end inclusive: one byte
    more than a valid part may hold tells a longer one without reading it)."""

    value: int
    """The longest value (blob + envelope) the reader expects."""

    @property
    def head(self) -> int:
        return self.value + FRAME_LEN

    @property
    def tail(self) -> int:
        return TAIL_FRAME_LEN + self.value // 4


class _Torn:
    """A head and a tail of two writes, read between them (read again)."""

    def __repr__(self) -> str:
        return "TORN"


TORN = _Torn()


class PartDamage(CorruptEncodedKVError):
    """Damage in how a split value's parts fit (its frame, its tail): both parts go."""


def _refuse(name: str, why: str, reason: Reason) -> PartDamage:
    return PartDamage(f"{name!r} (stored in two parts): {why}", reason=reason)


Assemble = Callable[[Any, Any, int], Any]
"""``assemble(head, tail, at)``: the value of a split head and its tail that passed every check
(``at``: the length of the head's MAC envelope, 0 or :data:`ENVELOPE_LEN`)."""


def concat(head: Any, tail: Any, at: int) -> bytes:
    """The value of a head and its tail, as a new ``bytes`` (replies read by redis-py)."""
    mv = memoryview(head)
    return b"".join((mv[:at], mv[at + FRAME_LEN :], memoryview(tail)[TAIL_FRAME_LEN:]))


def in_place(head: Part, tail: Part) -> Assemble:
    """The assembler of two replies of one buffer (:mod:`.redis_wire`), the tail after the head: the
    tail's bytes are moved up to the head's end, the envelope over the frame; no new buffer."""

    def assemble(_h: Any, _t: Any, at: int) -> Any:
        if head.buf is not tail.buf or tail.start < head.end:
            return concat(head.view(), tail.view(), at)
        buf, n = head.buf, len(tail) - TAIL_FRAME_LEN
        buf[head.end : head.end + n] = buf[tail.start + TAIL_FRAME_LEN : tail.end]
        start = head.start + FRAME_LEN
        buf[start : start + at] = buf[head.start : head.start + at]
        return Part(buf, start, head.end + n).view()

    return assemble


def join(
    name: str, head: Any, tail: Any, lim: Limits, tail_wrong_type: bool, assemble: Assemble = concat
) -> Any:
    """The value a head (and its tail, as read) holds: the head itself when it is whole; None when
    its tail is gone (evicted alone: a miss); :data:`TORN` when the tail is another write's. Damage
    (a frame that does not add up, a tail too long or of another type) raises CorruptEncodedKVError."""
    at = _envelope_len(head)
    if head[at : at + len(SPLIT_MAGIC)] != SPLIT_MAGIC:
        return head
    if len(head) < at + FRAME_LEN:
        raise _refuse(name, f"a {len(head)}-byte head", Reason.TRUNCATED_HEADER)
    _, write_id, tail_len = _FRAME.unpack_from(head, at)
    if not 0 < tail_len <= lim.tail - TAIL_FRAME_LEN:
        raise _refuse(name, f"a {tail_len}-byte tail declared", Reason.SIZE_MISMATCH)
    if tail_wrong_type:
        raise _refuse(name, "its tail holds another type than a string", Reason.WRONG_TYPE)
    if not isinstance(tail, (bytes, memoryview)) or len(tail) == 0:
        return None
    if len(tail) < TAIL_FRAME_LEN:
        raise _refuse(name, f"a {len(tail)}-byte tail", Reason.TRUNCATED_PAYLOAD)
    if tail[:TAIL_FRAME_LEN] != write_id:
        return TORN
    if len(tail) != TAIL_FRAME_LEN + tail_len:
        got = len(tail) - TAIL_FRAME_LEN
        reason = Reason.TRUNCATED_PAYLOAD if got < tail_len else Reason.SIZE_MISMATCH
        raise _refuse(name, f"a tail of {got} bytes, {tail_len} declared", reason)
    return assemble(head, tail, at)


def read_value(
    name: str,
    exists: int,
    head: Any,
    tail: Any,
    lim: Limits,
    wrong_type: tuple[bool, bool],
    assemble: Assemble = concat,
) -> Any:
    """The value of one read (``EXISTS``, the head's and the tail's ``GETRANGE``, as bytes or views;
    ``wrong_type``: each ``GETRANGE`` answered ``WRONGTYPE``): None for a miss, :data:`TORN`, or
    the whole value (bytes-like; ``assemble`` puts a split one together). Damage
    (another type, an empty head, a head longer than the reader takes, a split that does not add up)
    raises CorruptEncodedKVError."""
    if wrong_type[0]:
        raise CorruptEncodedKVError(f"{name!r} holds another type than a blob", reason=Reason.WRONG_TYPE)
    if not exists:
        return None
    if len(head) == 0:
        raise CorruptEncodedKVError(f"{name!r} is empty", reason=Reason.TRUNCATED_HEADER)
    if len(head) > lim.head:
        raise CorruptEncodedKVError(
            f"{name!r} is longer than the {lim.value - ENVELOPE_LEN} bytes its reader expects "
            f"(+{ENVELOPE_LEN} for a MAC): not read",
            reason=Reason.SIZE_MISMATCH,
        )
    return join(name, head, tail, lim, wrong_type[1], assemble)


def read_commands(name: str, lim: Limits) -> tuple[Command, ...]:
    """The commands that read the value ``name``: ``EXISTS``, the head's and the tail's ``GETRANGE``."""
    return (  # GETRANGE's end is inclusive: a longer value is told (one byte more), not read
        Command(("EXISTS", name)),
        Command(("GETRANGE", name, 0, lim.head), lim.head + 1),
        Command(("GETRANGE", tail_name(name), 0, lim.tail), lim.tail + 1),
    )


def peek_commands(name: str) -> tuple[Command, ...]:
    """The commands that tell whether the value ``name`` is there (a lookup): ``EXISTS``, its first
    :data:`PEEK_LEN` bytes (a MAC envelope and a split value's frame) and its tail's ``EXISTS``."""
    return (
        Command(("EXISTS", name)),
        Command(("GETRANGE", name, 0, PEEK_LEN - 1), PEEK_LEN),
        Command(("EXISTS", tail_name(name))),
    )

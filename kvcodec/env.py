"""Environment switches read in one place (no torch, no Triton: importing this costs nothing).

``TRITON_INTERPRET`` decides whether Triton runs kernels in its CPU
interpreter. Triton reads it with its own boolean parser; kvcodec must agree
with it exactly, or the kernels would be planned for the interpreter while
Triton compiles for a GPU (or the reverse). :func:`triton_interpret` is that
parser, written down: the value lower-cased, with no whitespace stripped,
is true for ``1``, ``true``, ``on``, ``yes`` and ``y``; anything else
(unset, empty, ``0``, ``false``, ``2``, `` 1``) is false.

``KVCODEC_REDIS_READS`` says how the Redis store receives a read's values:
``wire`` (the default: its own sockets, one buffer, :mod:`kvcodec.store.redis_wire`)
or ``client`` (redis-py's pipeline, hiredis when installed): the benchmark's
side-by-side rows, and a way back should a proxy speak RESP oddly.

``KVCODEC_REDIS_READ_AHEAD`` says whether a load's later chunks are asked for ahead of their reads:
``auto`` (the default: only from a server across a network, not one on this host's loopback or a
Unix socket, whose work would take the engine's own cores), ``on`` or ``off``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = [
    "REDIS_READS",
    "REDIS_READ_AHEAD",
    "TRITON_INTERPRET_TRUE",
    "redis_read_ahead",
    "redis_reads",
    "triton_interpret",
]

TRITON_INTERPRET_TRUE = frozenset({"1", "true", "on", "yes", "y"})
"""Lower-cased values Triton (3.6 to 3.9) reads as "on" for a boolean variable."""


def triton_interpret(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``TRITON_INTERPRET`` (in ``environ``, default ``os.environ``) turns Triton's interpreter on."""
    env = os.environ if environ is None else environ
    return env.get("TRITON_INTERPRET", "").lower() in TRITON_INTERPRET_TRUE


REDIS_READS = ("wire", "client")
"""The values of ``KVCODEC_REDIS_READS``, the default first."""


def _choice(name: str, ways: tuple[str, ...], environ: Mapping[str, str] | None) -> str:
    """``name``'s value (stripped, lower-cased) if it is one of ``ways``, else the first of them."""
    value = (os.environ if environ is None else environ).get(name, "").strip().lower()
    return value if value in ways else ways[0]


def redis_reads(environ: Mapping[str, str] | None = None) -> str:
    """How the Redis store receives reads: ``KVCODEC_REDIS_READS`` if it names a way, else ``wire``."""
    return _choice("KVCODEC_REDIS_READS", REDIS_READS, environ)


REDIS_READ_AHEAD = ("auto", "on", "off")
"""The values of ``KVCODEC_REDIS_READ_AHEAD``, the default first."""


def redis_read_ahead(environ: Mapping[str, str] | None = None) -> str:
    """Whether the Redis store reads ahead: ``KVCODEC_REDIS_READ_AHEAD`` if it names a way, else ``auto``."""
    return _choice("KVCODEC_REDIS_READ_AHEAD", REDIS_READ_AHEAD, environ)

"""Environment switches read in one place (no torch, no Triton: importing this costs nothing).

``TRITON_INTERPRET`` decides whether Triton runs kernels in its CPU
interpreter. Triton reads it with its own boolean parser; kvcodec must agree
with it exactly, or the kernels would be planned for the interpreter while
Triton compiles for a GPU (or the reverse). :func:`triton_interpret` is that
parser, written down: the value lower-cased, with no whitespace stripped,
is true for ``1``, ``true``, ``on``, ``yes`` and ``y``; anything else
(unset, empty, ``0``, ``false``, ``2``, `` 1``) is false.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["TRITON_INTERPRET_TRUE", "triton_interpret"]

TRITON_INTERPRET_TRUE = frozenset({"1", "true", "on", "yes", "y"})
"""Lower-cased values Triton (3.6 to 3.9) reads as "on" for a boolean variable."""


def triton_interpret(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``TRITON_INTERPRET`` (in ``environ``, default ``os.environ``) turns Triton's interpreter on."""
    env = os.environ if environ is None else environ
    return env.get("TRITON_INTERPRET", "").lower() in TRITON_INTERPRET_TRUE

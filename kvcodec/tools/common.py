"""What every ``kvcodec`` subcommand shares: exit codes, errors, argument types, text helpers.

Light on purpose (no torch): building the parser for ``kvcodec --help`` imports
this module and every command module, never the codec.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any, NoReturn

from ..format import HASH_KEYS, MAX_DIM

__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_USAGE",
    "HASH_KEYS",
    "PROG",
    "CLIError",
    "Parser",
    "UsageError",
    "add_expect_args",
    "bytes_str",
    "dtype_name",
    "escape_text",
    "expected_hashes",
    "finite_float",
    "hashes_from",
    "human",
    "identifier",
    "join",
    "page_size",
    "positive",
    "torch_dtype",
]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

PROG = "kvcodec"


class CLIError(Exception):
    """A failure to report as one line; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.code = code


class UsageError(Exception):
    """Raised by the parser instead of exiting (carries argparse's message)."""


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line and never exit the interpreter."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


# ----------------------------------------------------------------------------- argument types


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def positive(text: str) -> int:
    """An integer >= 1."""
    n = _int(text, "a positive integer")
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def page_size(text: str) -> int:
    """Tokens per page: 1..MAX_DIM (the most a header may declare)."""
    n = positive(text)
    if n > MAX_DIM:
        raise argparse.ArgumentTypeError(f"page size {n} is larger than the format's limit {MAX_DIM}")
    return n


def identifier(text: str) -> int:
    """A layer or chunk id: an integer >= -1 (-1 = unset)."""
    n = _int(text, "an integer >= -1")
    if n < -1:
        raise argparse.ArgumentTypeError(f"expected an integer >= -1 (-1 = unset), got {n}")
    return n


def finite_float(text: str) -> float:
    """A finite number (``nan`` and ``inf`` would make a threshold meaningless)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return x


# ----------------------------------------------------------------------------- identity hashes


def add_expect_args(p: argparse.ArgumentParser) -> None:
    """``--expect-<hash> STR`` for each identity hash, and ``--strict-hashes``."""
    g = p.add_argument_group("identity checks (empty values are wildcards, as in LMCache)")
    for key in HASH_KEYS:
        g.add_argument(
            f"--expect-{key.replace('_', '-')}",
            dest=f"expect_{key}",
            metavar="STR",
            help=f"refuse blobs whose {key} differs",
        )
    g.add_argument(
        "--strict-hashes",
        action="store_true",
        help="also refuse blobs that lack a hash given with --expect-*",
    )


def hashes_from(args: argparse.Namespace, prefix: str) -> dict[str, str]:
    """The hash options given (``prefix`` is "" for encode, "expect_" for checks)."""
    return {key: val for key in HASH_KEYS if (val := getattr(args, prefix + key, None))}


def expected_hashes(args: argparse.Namespace) -> dict[str, str] | None:
    """What ``decode(expected_hashes=...)`` should check, or None for no check."""
    expected = hashes_from(args, "expect_")
    return expected if (expected or args.strict_hashes) else None


# ----------------------------------------------------------------------------- text


def human(n: float) -> str:
    """Bytes as ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def bytes_str(n: int) -> str:
    """``1,536 (1.5 KiB)``, or just ``512`` under a KiB."""
    return f"{n:,} ({human(n)})" if n >= 1024 else f"{n:,}"


_NAMED_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(ch: str) -> str:
    if ch in _NAMED_ESCAPES:
        return _NAMED_ESCAPES[ch]
    if ch.isprintable():
        return ch
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def escape_text(text: object) -> str:
    """``text`` safe for a terminal: control and other non-printable characters (ESC, newlines,
    bidi overrides) shown as Python-style escapes, backslashes doubled; printable UTF-8 kept."""
    s = str(text)
    if s.isprintable() and "\\" not in s:
        return s
    return "".join(_escape_char(ch) for ch in s)


def torch_dtype(name: str | None) -> Any:
    """``fp16``/``bf16``/``fp32`` (or None) as a torch dtype (imports torch)."""
    import torch

    return {None: None, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


def dtype_name(dtype: Any) -> str:
    """``torch.float16`` as ``float16``."""
    return str(dtype).removeprefix("torch.")


def join(items: Sequence[object]) -> str:
    """``a, b, c``."""
    return ", ".join(str(i) for i in items)

"""The ``kvcodec`` command line: inspect, verify, encode, decode, quality, demo (and tune).

Each subcommand lives in its own module with ``add_parser(subparsers)`` and
``run(args)``; this module only builds the parser from them and turns every
failure into one ``kvcodec: error: ...`` line on stderr and a non-zero exit
status (2 for usage errors, 1 for bad blobs and other failures), never a
traceback (set ``KVCODEC_DEBUG=1`` to get one). Command modules import heavy
packages (torch, numpy, safetensors, tqdm) only when they run, so
``kvcodec --help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from . import cmd_decode, cmd_demo, cmd_encode, cmd_inspect, cmd_quality, cmd_verify
from .common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    CLIError,
    Parser,
    UsageError,
    escape_text,
    positive,
)

__all__ = ["COMMANDS", "EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE", "CLIError", "build_parser", "main"]

COMMANDS: tuple[ModuleType, ...] = (cmd_inspect, cmd_verify, cmd_encode, cmd_decode, cmd_quality, cmd_demo)
"""The built-in subcommand modules, in ``--help`` order."""

TUNE_MODULE = "kvcodec.tools.tune"
"""The optional ``tune`` subcommand (Triton kernel tuning), registered when the module is present."""


def _register(sub: Any, module: Any) -> None:
    """Add ``module``'s subcommand(s) to ``sub``, each running ``module.run``."""
    before = set(sub.choices)
    module.add_parser(sub)
    for name in set(sub.choices) - before:
        parser = sub.choices[name]
        if parser.get_default("func") is None:
            parser.set_defaults(func=module.run)


def _tune_unavailable(reason: str) -> Any:
    def run(_args: argparse.Namespace) -> int:
        raise CLIError(f"kvcodec tune is not available: {reason}")

    return run


def _register_tune(sub: Any) -> None:
    """``tune`` from :data:`TUNE_MODULE` if it exists and imports, else a stub that says why not."""
    try:
        present = importlib.util.find_spec(TUNE_MODULE) is not None
    except (ImportError, ValueError):
        present = False
    reason = f"{TUNE_MODULE} is not installed"
    if present:
        try:
            _register(sub, importlib.import_module(TUNE_MODULE))
            return
        except ImportError as e:
            reason = f"{TUNE_MODULE} could not be imported ({e}); it needs the triton extra"
    # Any arguments are accepted (no option prefix), so the run can say why tune is missing.
    s = sub.add_parser(
        "tune", help="tune the Triton kernels (not available here)", add_help=False, prefix_chars="\0"
    )
    s.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    s.set_defaults(func=_tune_unavailable(reason))


def build_parser() -> argparse.ArgumentParser:
    """The ``kvcodec`` argument parser: global options, then one subparser per command module."""
    p = Parser(
        prog=PROG,
        description="LMCKV KV-cache blobs: K bit-exact at fp16/bf16, V in FP8 e4m3 (LMCache-compatible).",
        epilog="Exit status: 0 ok, 1 bad blobs or failures, 2 usage errors.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    p.add_argument(
        "--threads",
        type=positive,
        metavar="N",
        help="torch CPU threads (default: torch's own choice; 1 for demo)",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    for module in COMMANDS:
        _register(sub, module)
    _register_tune(sub)
    return p


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvcodec")
    except Exception:
        return "unknown"


# ----------------------------------------------------------------------------- entry point


_CREDENTIALS = re.compile(r"\b([A-Za-z][\w+.-]*:/+)\S*@")
"""A URL's scheme and its text up to the last ``@`` of the word (credentials), as any message may hold
them (a path made of a URL keeps one slash of two)."""


def _error(message: str) -> None:
    """One line on stderr: whitespace collapsed, control characters escaped, a URL's credentials
    replaced by ``***`` (whatever command or scheme printed them)."""
    text = _CREDENTIALS.sub(r"\1***@", " ".join(str(message).split()))
    print(f"{PROG}: error: {escape_text(text)}", file=sys.stderr)


def _os_message(e: OSError) -> str:
    if e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e) or type(e).__name__


def _quiet_stdout() -> None:
    """The reader went away (e.g. ``| head``): send what is left of stdout nowhere."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _report(e: Exception) -> int:
    """The exit status for an unexpected ``e``, after printing its one line."""
    from ..errors import CodecError

    if isinstance(e, CodecError):
        _error(str(e))
    elif isinstance(e, OSError):
        _error(_os_message(e))
    else:
        _error(f"unexpected {type(e).__name__}: {e} (set KVCODEC_DEBUG=1 for a traceback)")
    return EXIT_FAILURE


def _run(args: argparse.Namespace) -> int:
    if args.threads is not None and args.command != "demo":
        import torch

        torch.set_num_threads(args.threads)
    return int(args.func(args))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        _error(str(e))
        return EXIT_USAGE
    except SystemExit as e:  # --help / --version
        return e.code if isinstance(e.code, int) else EXIT_OK
    try:
        return _run(args)
    except CLIError as e:
        _error(str(e))
        return e.code
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_FAILURE
    except Exception as e:
        if os.environ.get("KVCODEC_DEBUG", "") not in ("", "0"):
            raise
        return _report(e)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

"""``kvcodec verify``: check blobs, files or whole folders (a store), by decoding them.

A blob verifies only if :func:`kvcodec.decode` accepts it: the check runs the
decoder itself (parse, CRC, hashes, then K and V, V dequantized unless the blob
is external-scope without stored scales, whose scales only the caller has),
then V's values: an FP8 NaN/Inf code, or a stored scale that makes a code Inf,
is reported with its token, head and scale group. So a blob that verifies
decodes, to finite values. Memory per blob is bounded by its own V bytes.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import stat
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .common import EXIT_FAILURE, EXIT_OK, PROG, CLIError, add_expect_args, escape_text, expected_hashes, join
from .files import read_blob, require_files
from .progress import Progress, progress_enabled
from .stores import add_store_args

__all__ = ["add_parser", "collect", "run", "verify_blob"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``verify``."""
    s = sub.add_parser(
        "verify",
        help="check blobs (magic, lengths, CRC, consistency, hashes) by decoding them",
        description="Check blobs by decoding them (a blob that verifies decodes); folders are walked "
        "recursively, skipping hidden entries (.quarantine); a store URL (redis://...) is walked key by "
        "key (a blob the store itself refuses is removed by it, as on a load).",
    )
    s.add_argument("paths", nargs="+", metavar="FILE|DIR|URL")
    s.add_argument("--strict", action="store_true", help="refuse trailing bytes after a v1 payload")
    s.add_argument(
        "--glob",
        default="*",
        metavar="PATTERN",
        help="in folders and stores, check only files (keys) matching (e.g. '*.blob')",
    )
    s.add_argument("-v", "--verbose", action="store_true", help="also list good blobs")
    s.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr for folders (default: only when stderr is a terminal)",
    )
    add_expect_args(s)
    add_store_args(s)
    return s


# ----------------------------------------------------------------------------- finding files


def _is_regular(p: Path) -> bool:
    """Only regular files are blobs: a FIFO or device in a tree must not hang a walk."""
    try:
        return stat.S_ISREG(os.stat(p).st_mode)
    except OSError:
        return True  # let the read report why it cannot be read


def _raise(e: OSError) -> None:
    raise e


def _walk(root: Path, pattern: str = "*") -> Iterator[Path]:
    """Files under ``root`` whose name matches ``pattern``, sorted, skipping hidden files and
    folders (e.g. ``.quarantine`` and a store's temp files)."""
    for dirpath, dirnames, filenames in os.walk(root, onerror=_raise):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if not name.startswith(".") and fnmatch.fnmatchcase(name, pattern) and _is_regular(p):
                yield p


def collect(paths: Sequence[Path], pattern: str = "*") -> tuple[list[Path], bool]:
    """Files to verify (each once), and whether any directory was given."""
    files: list[Path] = []
    seen: set[str] = set()
    any_dir = False
    for p in paths:
        found: Iterable[Path] = (p,)
        if p.is_dir():
            any_dir = True
            found = _walk(p, pattern)
        for f in found:
            real = os.path.realpath(f)
            if real not in seen:  # a file named twice (or inside a named folder) is checked once
                seen.add(real)
                files.append(f)
    return files, any_dir


# ----------------------------------------------------------------------------- checking


def verify_blob(
    data: Any, *, strict: bool = False, expected: dict[str, str] | None = None, strict_hashes: bool = False
) -> None:
    """Raise the CodecError that decoding ``data`` raises, if any (V dequantized when possible).

    Beyond what decode refuses, V must decode to finite values, as a load would put them in a
    cache: FP8 NaN/Inf codes (``Reason.BAD_CODE``) and a stored scale that overflows a code to
    Inf are refused with the group where they occur, as stored NaN scales already are.
    """
    import torch

    from ..codec import decode
    from ..codec.lossless import expand_blob, is_lossless
    from ..format import ScaleScope, parse
    from ..format.parser import check_v_codes

    parsed = parse(data, verify_crc=True, strict=strict)
    if is_lossless(parsed.header):  # its codes are coded: check those of the plain blob it holds
        parsed = parse(expand_blob(parsed), verify_crc=False)
    h = parsed.header
    scales_missing = h.scale_scope == ScaleScope.EXTERNAL and h.scale_payload_len == 0
    d = decode(
        parsed,
        out_v_dtype=None if scales_missing else torch.float32,
        expected_hashes=expected,
        strict_hashes=strict_hashes,
    )
    check_v_codes(h, parsed.v)
    _check_finite(h, d.v)


def _check_finite(h: Any, v: Any) -> None:
    """Refuse decoded V holding NaN or Inf (codes were finite: a scale made them so)."""
    import torch

    from ..errors import CorruptEncodedKVError, Reason
    from ..format import FLOAT8_DTYPES
    from ..format.parser import v_group

    if v is None or not v.is_floating_point() or v.element_size() == 1:
        return  # raw FP8: check_v_codes has looked at every code
    bad = ~torch.isfinite(v.reshape(-1))
    if not bool(bad.any()):
        return
    first = int(torch.argmax(bad.to(torch.uint8)))
    fp8 = h.v_dtype in FLOAT8_DTYPES  # then every code is finite: the scale overflowed it
    raise CorruptEncodedKVError(
        f"V decodes to {int(bad.sum())} NaN/Inf value(s), the first at element {first} "
        f"({v_group(h, first)})"
        + ("; its code is finite, so its stored scale overflows float32" if fp8 else ""),
        reason=Reason.BAD_SCALE if fp8 else Reason.BAD_CODE,
    )


def _verify_data(data: Any, args: argparse.Namespace) -> str | None:
    """None if ``data`` is a good blob, else why not."""
    from ..errors import CodecError

    try:
        verify_blob(
            data, strict=args.strict, expected=expected_hashes(args), strict_hashes=args.strict_hashes
        )
    except CodecError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _verify_one(path: Path, args: argparse.Namespace) -> str | None:
    """None if ``path`` holds a good blob, else why not."""
    from ..errors import CodecError

    try:
        data = read_blob(path, strict=args.strict).data  # header first: never more than it declares
    except (CLIError, OSError) as e:
        return str(e).removeprefix(f"{path}: ") if isinstance(e, CLIError) else e.strerror or str(e)
    except CodecError as e:
        return f"{type(e).__name__}: {e}"
    return _verify_data(data, args)


class _Tally:
    """Good and bad blobs so far; prints each bad one (and good ones when verbose)."""

    def __init__(self, verbose: bool) -> None:
        self.ok = self.bad = 0
        self.verbose = verbose

    def add(self, name: object, err: str | None, write: Any = print) -> None:
        if err is None:
            self.ok += 1
            if self.verbose:
                write(f"{escape_text(name)}: ok")
        else:
            self.bad += 1
            write(f"{escape_text(name)}: {escape_text(err)}")


def _verify_files(files: list[Path], args: argparse.Namespace, tally: _Tally, bar_on: bool) -> None:
    with Progress(len(files), "verify", enabled=bar_on and progress_enabled(args.progress)) as bar:
        for f in files:
            tally.add(f, _verify_one(f, args), bar.write)
            bar.update()


def _verify_store(url: str, args: argparse.Namespace, tally: _Tally) -> None:
    """Every blob of the store at ``url`` (keys matching ``--glob``), one in memory at a time."""
    from .stores import store_blobs

    for item in store_blobs(url, args, pattern=args.glob):
        tally.add(item.name, item.error if item.blob is None else _verify_data(item.blob, args))


def run(args: argparse.Namespace) -> int:
    """Check every blob; print bad ones and a summary; exit 1 if any is bad."""
    from .stores import check_urls, is_store_url, location_of

    check_urls(args.paths)
    urls = [p for p in args.paths if is_store_url(p)]
    paths = [Path(p) for p in args.paths if not is_store_url(p)]
    require_files(paths, allow_dirs=True)
    files, any_dir = collect(paths, args.glob)
    tally = _Tally(args.verbose)
    _verify_files(files, args, tally, any_dir)
    for url in urls:
        _verify_store(url, args, tally)
    if not tally.ok + tally.bad:
        where = join([location_of(p) if is_store_url(p) else p for p in args.paths])
        print(f"{PROG}: warning: no blobs found under {escape_text(where)}", file=sys.stderr)
    print(f"verified {tally.ok + tally.bad} blobs: {tally.ok} ok, {tally.bad} bad")
    return EXIT_FAILURE if tally.bad else EXIT_OK

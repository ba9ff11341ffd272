"""``kvcodec inspect``: show each blob's header, CRC status and sizes.

Strings taken from a blob (hashes, unknown hash keys) are shown escaped in the
table, so escape sequences or newlines stored in a blob never reach the
terminal raw; ``--json`` output escapes them as JSON does (and stays ASCII).
Needs only the pure-Python format layer, never torch. A store URL
(``redis://...``) is walked key by key through :mod:`kvcodec.tools.stores`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .common import EXIT_FAILURE, EXIT_OK, CLIError, bytes_str, escape_text
from .files import read_blob, require_files
from .stores import add_store_args

__all__ = ["add_parser", "inspect_data", "inspect_one", "inspect_table", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``inspect``."""
    s = sub.add_parser("inspect", help="show blob headers", description="Show each blob's header as a table.")
    s.add_argument("files", nargs="+", metavar="FILE|URL")
    s.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per file (a list for several); a store's blobs one object per line",
    )
    add_store_args(s)
    return s


def inspect_one(path: Path) -> dict[str, Any]:
    """Header fields, CRC status and sizes of one blob, or ``{"file", "error"}``."""
    from ..errors import CodecError

    try:
        blob = read_blob(path)  # header first: never more than the header declares
    except CLIError as e:
        return {"file": str(path), "error": str(e).removeprefix(f"{path}: ")}
    except CodecError as e:
        return {"file": str(path), "error": str(e)}
    return inspect_data(str(path), blob.data, blob.file_size, blob.trailing)


def inspect_data(name: str, data: Any, size: int, trailing: int = 0) -> dict[str, Any]:
    """What :func:`inspect_one` shows, for blob bytes read from anywhere (a file, a store)."""
    from ..errors import CodecError
    from ..format import MAGIC, header_fields, parse, payload_crc

    info: dict[str, Any] = {"file": name, "file_size": size}
    try:
        parsed = parse(data, verify_crc=False)
    except CodecError as e:
        info["error"] = str(e)
        return info
    h = parsed.header
    crc = payload_crc(h, parsed.crc_prefix, (parsed.payload,))
    info["magic"] = MAGIC.decode("latin-1").encode("unicode_escape").decode("ascii")
    info.update(header_fields(h))
    info["tokens"] = h.num_tokens
    info["header_len"] = parsed.header_len
    info["payload_len"] = h.payload_len
    info["trailing_bytes"] = trailing + parsed.trailing
    info["unknown_hashes"] = dict(parsed.unknown_hashes)
    info["crc"] = f"{parsed.crc:#010x}"
    info["crc_computed"] = f"{crc:#010x}"
    info["crc_ok"] = crc == parsed.crc
    return info


_ROWS: tuple[tuple[str, str], ...] = (
    ("magic", "magic"),
    ("version", "version"),
    ("scale_scope", "scope"),
    ("scale_scheme", "scale scheme"),
    ("k_dtype", "K dtype"),
    ("v_dtype", "V dtype"),
    ("scale_dtype", "scale dtype"),
    ("layer_id", "layer id"),
    ("chunk_id", "chunk id"),
    ("chunk_size", "chunk size"),
    ("tokens", "tokens held"),
    ("page_size", "page size"),
    ("kv_head_count", "KV heads"),
    ("head_dim", "head dim"),
    ("scale_shape", "scale shape"),
    ("k_payload_len", "K bytes"),
    ("v_payload_len", "V bytes"),
    ("scale_payload_len", "scale bytes"),
    ("header_len", "header bytes"),
    ("file_size", "file bytes"),
    ("trailing_bytes", "trailing bytes"),
)
_LAYOUT_INTS = frozenset({"layer_id", "chunk_id", "chunk_size", "page_size", "kv_head_count", "head_dim"})


def _cell(key: str, val: Any) -> str:
    """One header value as table text."""
    if key == "scale_shape":
        return "(" + ", ".join(str(d) for d in val) + ("," if len(val) == 1 else "") + ")"
    if key.endswith(("_len", "_size", "_bytes")) and isinstance(val, int) and val >= 0:
        return bytes_str(val)
    if key in _LAYOUT_INTS:
        return "unset (-1)" if val == -1 else str(val)
    return "unknown" if val is None else str(val)


def _rows(info: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for key, label in _ROWS:
        text = _cell(key, info.get(key))
        if key == "scale_scheme" and info.get("version") == 1:
            text += " (v1: implied)"
        rows.append((label, text))
    for key, val in info["hashes"].items():
        rows.append((f"hash {key}", escape_text(val) if val else "-"))
    for key, val in info["unknown_hashes"].items():
        rows.append((f"hash {escape_text(key)} (unknown)", escape_text(val) if val else "-"))
    crc = info["crc"] + ("  ok" if info["crc_ok"] else f"  BAD (payload gives {info['crc_computed']})")
    rows.append(("CRC", crc))
    return rows


def inspect_table(info: dict[str, Any]) -> str:
    """One blob's info as an indented two-column table."""
    lines = [f"== {escape_text(info['file'])}"]
    if "error" in info:
        lines.append(f"  error: {escape_text(info['error'])}")
        return "\n".join(lines)
    rows = _rows(info)
    width = max(len(r[0]) for r in rows)
    lines += [f"  {label:<{width}}  {text}" for label, text in rows]
    return "\n".join(lines)


def _bad(info: dict[str, Any]) -> bool:
    return "error" in info or not info["crc_ok"]


def _inspect_store(url: str, args: argparse.Namespace) -> int:
    """Each blob of the store at ``url``, printed as it is read (``--json``: one object per line)."""
    from .stores import store_blobs

    bad = 0
    for item in store_blobs(url, args, verify_crc=False):
        if item.blob is None:
            info: dict[str, Any] = {"file": item.name, "error": item.error}
        else:
            info = inspect_data(item.name, item.blob, len(item.blob))
        bad += _bad(info)
        print(json.dumps(info, ensure_ascii=True) if args.json else inspect_table(info) + "\n")
    return bad


def run(args: argparse.Namespace) -> int:
    """Show each blob's header; exit 1 if any file is unreadable, malformed or fails its CRC."""
    from .stores import check_urls, is_store_url

    check_urls(args.files)
    paths = [Path(p) for p in args.files if not is_store_url(p)]
    require_files(paths)
    infos = [inspect_one(p) for p in paths]
    if infos and args.json:
        print(json.dumps(infos[0] if len(infos) == 1 else infos, indent=2, ensure_ascii=True))
    elif infos:
        print("\n\n".join(inspect_table(i) for i in infos))
    bad = sum(_bad(i) for i in infos)
    for url in (p for p in args.files if is_store_url(p)):
        bad += _inspect_store(url, args)
    return EXIT_FAILURE if bad else EXIT_OK

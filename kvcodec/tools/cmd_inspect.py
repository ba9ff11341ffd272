"""``kvcodec inspect``: show each blob's header, CRC status and sizes.

Strings taken from a blob (hashes, unknown hash keys) are shown escaped in the
table, so escape sequences or newlines stored in a blob never reach the
terminal raw; ``--json`` output escapes them as JSON does (and stays ASCII).
Needs only the pure-Python format layer, never torch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .common import EXIT_FAILURE, EXIT_OK, CLIError, bytes_str, escape_text
from .files import read_blob, require_files

__all__ = ["add_parser", "inspect_one", "inspect_table", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``inspect``."""
    s = sub.add_parser("inspect", help="show blob headers", description="Show each blob's header as a table.")
    s.add_argument("files", nargs="+", metavar="FILE")
    s.add_argument("--json", action="store_true", help="one JSON object per file (a list for several)")
    return s


def inspect_one(path: Path) -> dict[str, Any]:
    """Header fields, CRC status and sizes of one blob, or ``{"file", "error"}``."""
    from ..errors import CodecError
    from ..format import MAGIC, header_fields, parse, payload_crc

    info: dict[str, Any] = {"file": str(path)}
    try:
        blob = read_blob(path)  # header first: never more than the header declares
        info["file_size"] = blob.file_size
        parsed = parse(blob.data, verify_crc=False)
    except CLIError as e:
        info["error"] = str(e).removeprefix(f"{path}: ")
        return info
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
    info["trailing_bytes"] = blob.trailing
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


def run(args: argparse.Namespace) -> int:
    """Show each blob's header; exit 1 if any file is unreadable, malformed or fails its CRC."""
    paths = [Path(p) for p in args.files]
    require_files(paths)
    infos = [inspect_one(p) for p in paths]
    if args.json:
        print(json.dumps(infos[0] if len(infos) == 1 else infos, indent=2, ensure_ascii=True))
    else:
        print("\n\n".join(inspect_table(i) for i in infos))
    bad = [i for i in infos if "error" in i or not i["crc_ok"]]
    return EXIT_FAILURE if bad else EXIT_OK

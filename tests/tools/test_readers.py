"""The CLI's readers (inspect, verify, decode) read no more than a blob really holds.

A file's size is compared with the header + payload its header declares before the payload is
read: a sparse file of a few KiB on disk with a large apparent size costs its header, not its
apparent size (peak memory measured with tracemalloc; no timing).
"""

from __future__ import annotations

import json
import os
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch

from kvcodec import encode
from kvcodec.format import FIXED_HEADER_LEN, parse
from kvcodec.tools.cli import main
from kvcodec.tools.files import read_blob

APPARENT = 256 << 20
"""Apparent size of the sparse files (none of it is on disk)."""
PEAK_LIMIT = 16 << 20
"""Peak allocation allowed while a command reads one such file: far below its apparent size."""


def _blob(version: int = 2) -> bytearray:
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(64, 2, 16, generator=g).to(torch.float16) for _ in range(2))
    return encode(k, v, scope="per_page_head", page_size=16, version=version)


def _sparse(tmp_path: Path, blob: bytes, size: int = APPARENT) -> Path:
    path = tmp_path / "sparse.lmckv"
    path.write_bytes(blob)
    os.truncate(path, size)
    return path


def _argv(command: str, path: Path, tmp_path: Path) -> list[str]:
    if command == "decode":
        return ["decode", str(path), "--out", str(tmp_path / "out.npz")]
    return [command, str(path)]


def _peak(argv: list[str]) -> tuple[int, int]:
    """(exit status, peak bytes allocated while ``main(argv)`` ran)."""
    tracemalloc.start()
    try:
        code = main(argv)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return code, peak


@pytest.mark.parametrize("command", ["inspect", "verify", "decode"])
def test_a_sparse_v2_file_is_refused_at_the_cost_of_its_header(tmp_path: Path, capsys, command) -> None:
    path = _sparse(tmp_path, _blob())
    code, peak = _peak(_argv(command, path, tmp_path))
    out = capsys.readouterr()
    assert code == 1 and "trailing" in out.out + out.err
    assert peak < PEAK_LIMIT, f"{command} allocated {peak} bytes for a {APPARENT}-byte sparse file"


@pytest.mark.parametrize("command", ["inspect", "verify", "decode"])
def test_a_header_declaring_more_than_the_file_holds(tmp_path: Path, capsys, command) -> None:
    blob = _blob(version=1)  # v1: the header is outside the CRC, so the lie needs no reseal
    p = parse(blob)
    lens_at = FIXED_HEADER_LEN + 8 * len(p.header.scale_shape)
    struct.pack_into("<q", blob, lens_at + 8, 1 << 40)  # V: 1 TiB
    path = _sparse(tmp_path, blob)
    code, peak = _peak(_argv(command, path, tmp_path))
    out = capsys.readouterr()
    assert code == 1 and "truncated" in out.out + out.err
    assert peak < PEAK_LIMIT


def test_v1_trailing_bytes_are_counted_not_read(tmp_path: Path, capsys) -> None:
    blob = _blob(version=1)
    path = _sparse(tmp_path, blob)
    code, peak = _peak(["verify", str(path)])
    assert code == 0 and peak < PEAK_LIMIT and "1 ok" in capsys.readouterr().out
    assert main(["inspect", "--json", str(path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["trailing_bytes"] == APPARENT - len(blob) and info["file_size"] == APPARENT
    assert main(["verify", "--strict", str(path)]) == 1
    assert "trailing" in capsys.readouterr().out


def test_read_blob_reads_exactly_the_blob(tmp_path: Path) -> None:
    blob = _blob()
    path = tmp_path / "b.lmckv"
    path.write_bytes(blob)
    got = read_blob(path)
    assert got.data == bytes(blob) and got.trailing == 0 and got.file_size == len(blob)
    for cut in (10, FIXED_HEADER_LEN + 4, len(blob) - 1):  # inside the fixed part, the header, the payload
        path.write_bytes(blob[:cut])
        assert main(["verify", str(path)]) == 1


def test_a_huge_legal_header_still_reads(tmp_path: Path, capsys) -> None:
    """A 4 MiB header (64 unknown hash pairs of 64 KiB) is read whole: header lengths are not capped."""
    from tests.format.test_parser_memo import _huge_header_blob

    blob = _huge_header_blob(1)
    path = tmp_path / "huge.lmckv"
    path.write_bytes(blob)
    assert read_blob(path).data == bytes(blob)
    assert main(["verify", str(path)]) == 0
    capsys.readouterr()

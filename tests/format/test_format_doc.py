"""docs/FORMAT.md says what kvcodec.format does: its tables are checked against the struct layouts, ids and limits."""

from __future__ import annotations

import codecs
import re
import struct

import pytest

from kvcodec.format import (
    FIXED_HEADER_LEN,
    HASH_KEYS,
    ID_TO_DTYPE,
    MAGIC,
    Header,
    ScaleScheme,
    ScaleScope,
    expected_scale_shape,
    header_size,
)
from kvcodec.format import header as layouts
from tests.paths import REPO_ROOT

DOC = REPO_ROOT / "docs" / "FORMAT.md"


def _tables(text: str) -> dict[str, list[list[dict[str, str]]]]:
    """Every markdown table, as rows of {column: cell}, grouped under the heading above it."""
    out: dict[str, list[list[dict[str, str]]]] = {}
    heading, columns, rows = "", None, []
    for line in [*text.splitlines(), ""]:
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            if columns is not None:
                out.setdefault(heading, []).append(rows)
            columns, rows = None, []
        elif columns is None:
            columns = cells
        elif not set("".join(cells)) <= set("-: "):
            rows.append(dict(zip(columns, cells)))
    return out


@pytest.fixture(scope="module")
def tables() -> dict[str, list[list[dict[str, str]]]]:
    return _tables(DOC.read_text())


def _code(cell: str) -> str:
    return cell.strip("`")


def test_fixed_part_matches_the_struct_layout(tables) -> None:
    (rows,) = tables["Fixed part"]
    assert [r["field"] for r in rows] == list(layouts.FIXED_FIELDS)
    codes = [_code(r["struct"]) for r in rows]
    assert "<" + "".join(codes) == layouts.FIXED_HEADER.format
    for i, row in enumerate(rows):
        assert int(row["offset"]) == struct.calcsize("<" + "".join(codes[:i])), row
        assert int(row["size"]) == struct.calcsize("<" + codes[i]), row
    assert struct.calcsize("<" + "".join(codes)) == FIXED_HEADER_LEN
    assert codecs.escape_decode(_code(rows[0]["meaning"].split()[0]))[0] == MAGIC


def test_variable_part_matches_the_struct_layouts(tables) -> None:
    (rows,) = tables["Variable part"]
    want = {
        "scale_shape": layouts.SCALE_DIM,
        "payload lengths": layouts.PAYLOAD_LENS,
        "hash pair count": layouts.HASH_PAIR_COUNT,
        "hash string length": layouts.HASH_LEN,
        "CRC": layouts.CRC_FIELD,
    }
    assert [r["field"] for r in rows] == list(want)
    for row in rows:
        st = want[row["field"]]
        assert "<" + _code(row["struct"]) == st.format, row
        assert int(row["size"].removesuffix(" each")) == st.size, row


def test_the_stated_header_sizes_hold() -> None:
    sizes = re.search(
        r"(\d+) bytes for\s+per_tensor, (\d+) for per_layer_head and (\d+) for\s+per_page_head",
        DOC.read_text(),
    )
    assert sizes is not None
    for scope, shape, size in zip([0, 1, 2], [(), (2,), (1, 2)], map(int, sizes.groups())):
        h = Header(
            k_dtype="float16", v_dtype="float8_e4m3fn", scale_scope=ScaleScope(scope), scale_shape=shape
        )
        assert header_size(h) == size


def test_dtype_ids(tables) -> None:
    rows = tables["Ids"][0]
    got = {int(r["id"]): (r["dtype"], int(r["bytes"])) for r in rows}
    assert got == {i: (d.name, d.itemsize) for i, d in ID_TO_DTYPE.items()}


def test_scale_scopes_and_their_shapes(tables) -> None:
    rows = tables["Ids"][1]
    assert {int(r["id"]): r["scope"] for r in rows} == {s.value: s.name for s in ScaleScope}
    tokens, heads, page = 5, 3, 2
    names = {"heads": heads, "pages": -(-tokens // page)}
    for r in rows:
        want = expected_scale_shape(ScaleScope(int(r["id"])), tokens, heads, page)
        if want is not None:
            assert eval(_code(r["scale_shape"]), {}, names) == want, r  # a tuple display, nothing else


def test_scale_schemes(tables) -> None:
    rows = tables["Ids"][2]
    assert {int(r["id"]): r["scheme"] for r in rows} == {s.value: s.name for s in ScaleScheme}


def test_named_limits(tables) -> None:
    (rows,) = tables["Limits"]
    for row in rows:
        base, _, exp = row["value"].partition("^")
        value = int(base) ** int(exp) if exp else int(base)
        assert getattr(layouts, row["name"]) == value, row
    assert {r["name"] for r in rows} == {n for n in layouts.__all__ if n.startswith("MAX_")}


def test_hash_keys_in_check_order() -> None:
    section = DOC.read_text().split("### Hash keys", 1)[1].split("#", 1)[0]
    first_sentence = section.split(". ", 1)[0]
    assert tuple(re.findall(r"`(\w+)`", first_sentence)) == HASH_KEYS


def _points_at_docs(line: str) -> bool:
    return "FORMAT.md" not in line or "docs/FORMAT.md" in line or '"docs" / "FORMAT.md"' in line


def test_every_pointer_to_format_md_names_docs_format_md() -> None:
    """Every mention of the format document anywhere in the repo names docs/FORMAT.md."""
    paths = [REPO_ROOT / "README.md", REPO_ROOT / "ARCHITECTURE.md"]
    for folder in ("kvcodec", "kernels", "tests", "bench", "dev", "mk"):
        paths += sorted((REPO_ROOT / folder).rglob("*"))
    wrong = []
    for path in paths:
        if path.suffix not in (".py", ".md", ".c", ".h", ".mk") or "__pycache__" in path.parts:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if not _points_at_docs(line):
                wrong.append(f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()}")
    assert not wrong, "\n".join(wrong)

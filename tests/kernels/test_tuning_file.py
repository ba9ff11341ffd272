"""A hostile tuning file ($KVCODEC_TUNING_FILE) never breaks a launch: bad entries are skipped, a bad file is empty.

``TuningTable.load`` and ``tuned_config`` run on the first tile-kernel
launch of every process on a GPU, reading a file anyone with write access
to the user's cache (or the environment) controls. Each case here raised a
raw exception before (or, for the oversized file, read it whole into memory).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvcodec.kernels import configs
from kvcodec.kernels.configs import TUNING_FORMAT, TileConfig, TuningTable

GOOD = {
    "gpu": "G",
    "triton": "3.9.0",
    "kernel": "_quant_tiles_kernel",
    "key": "D=128,rows=16",
    "BLOCK_T": 16,
    "num_warps": 2,
}


def write(tmp_path: Path, obj: Any) -> Path:
    path = tmp_path / "tuning.json"
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def tuning_text(entries: str) -> str:
    """A tuning file's text whose entries are ``entries`` verbatim."""
    return '{"format": "' + TUNING_FORMAT + '", "entries": ' + entries + "}"


def table_of(tmp_path: Path, obj: Any) -> TuningTable:
    return TuningTable.load(write(tmp_path, obj))


@pytest.mark.parametrize("entries", [5, None, "entries", {"a": 1}, 1.5, True])
def test_entries_that_are_not_a_list_give_an_empty_table(tmp_path: Path, entries: Any) -> None:
    assert len(table_of(tmp_path, {"format": TUNING_FORMAT, "entries": entries})) == 0


@pytest.mark.parametrize("block_t", [1e999, -1e999, float("nan"), 16.5, "16", True, None, [16], {"a": 16}])
def test_an_entry_with_a_bad_number_is_skipped_and_the_others_kept(tmp_path: Path, block_t: Any) -> None:
    bad = {**GOOD, "key": "bad", "BLOCK_T": block_t}
    # json.dumps writes 1e999 as Infinity, which json.loads reads back as inf (as Python's json does for 1e999).
    table = table_of(tmp_path, {"format": TUNING_FORMAT, "entries": [bad, GOOD]})
    assert len(table) == 1
    assert table.get("G", "3.9.0", "_quant_tiles_kernel", "D=128,rows=16") == TileConfig(16, 2)


def test_a_literal_1e999_is_skipped(tmp_path: Path) -> None:
    text = json.dumps({"format": TUNING_FORMAT, "entries": [{**GOOD, "BLOCK_T": 0}]}).replace(
        '"BLOCK_T": 0', '"BLOCK_T": 1e999'
    )
    assert "1e999" in text
    assert len(table_of(tmp_path, text)) == 0


def test_an_integral_float_is_read_as_its_int(tmp_path: Path) -> None:
    table = table_of(tmp_path, {"format": TUNING_FORMAT, "entries": [{**GOOD, "BLOCK_T": 16.0}]})
    assert table.get("G", "3.9.0", "_quant_tiles_kernel", "D=128,rows=16") == TileConfig(16, 2)


@pytest.mark.parametrize(
    "entry", [5, None, "x", [1, 2], {**GOOD, "gpu": 3}, {k: v for k, v in GOOD.items() if k != "key"}]
)
def test_entries_that_are_not_entries_are_skipped(tmp_path: Path, entry: Any) -> None:
    table = table_of(tmp_path, {"format": TUNING_FORMAT, "entries": [entry, GOOD]})
    assert len(table) == 1


def test_deeply_nested_json_gives_an_empty_table(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    text = tuning_text("[" * 100_000 + "]" * 100_000)
    with caplog.at_level(logging.WARNING, logger="kvcodec.kernels"):
        assert len(table_of(tmp_path, text)) == 0
    assert "RecursionError" in caplog.text


def test_an_oversized_file_is_not_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pad = " " * (configs.MAX_TUNING_BYTES + 1)
    text = tuning_text("[" + json.dumps(GOOD) + "]") + pad
    with caplog.at_level(logging.WARNING, logger="kvcodec.kernels"):
        assert len(table_of(tmp_path, text)) == 0
    assert "larger than" in caplog.text


@pytest.mark.parametrize(
    "text", ["{not json", "\xff\xfe", "", "null", "[]", '{"format": "other/1", "entries": []}']
)
def test_a_file_that_is_not_a_tuning_file_gives_an_empty_table(tmp_path: Path, text: str) -> None:
    assert len(table_of(tmp_path, text)) == 0


def test_a_broken_file_is_read_and_logged_once_and_launches_use_the_heuristic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("triton")
    path = write(tmp_path, tuning_text("[" * 100_000))
    monkeypatch.setenv("KVCODEC_TUNING_FILE", str(path))
    loads = []
    real = TuningTable.load.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(TuningTable, "load", classmethod(lambda cls, p: loads.append(p) or real(cls, p)))
    configs.reload_tuning()
    try:
        with caplog.at_level(logging.WARNING, logger="kvcodec.kernels"):
            for _ in range(3):
                assert configs.tuned_config("G", "_quant_tiles_kernel", "D=128,rows=16", 128) is None
                got = configs.choose("_quant_tiles_kernel", {"D": 128}, 16, 128, gpu="G", interpret=False)
                assert got == configs.heuristic(16, 128)
    finally:
        configs.reload_tuning()
    assert loads == [path]
    assert caplog.text.count("tuning file") == 1


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
FIELD = st.sampled_from(["gpu", "triton", "kernel", "key", "BLOCK_T", "num_warps", "us"])
ENTRY = st.dictionaries(FIELD, JSON, max_size=7) | st.fixed_dictionaries(
    {k: JSON | st.just(v) for k, v in GOOD.items()}
)
FILE = JSON | st.fixed_dictionaries(
    {"format": st.just(TUNING_FORMAT), "entries": JSON | st.lists(ENTRY | JSON, max_size=5)}
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=FILE)
def test_any_json_loads_into_a_table_of_sane_configs(obj: Any) -> None:
    table = TuningTable.from_json(obj)
    for row in table.to_json()["entries"]:
        assert all(isinstance(row[f], str) for f in ("gpu", "triton", "kernel", "key"))
        cfg = table.get(row["gpu"], row["triton"], row["kernel"], row["key"])
        assert isinstance(cfg, TileConfig) and type(cfg.block_t) is int and type(cfg.num_warps) is int

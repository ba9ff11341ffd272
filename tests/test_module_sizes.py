"""Each module of the integrations and the store does one job: none is over 500 lines (issue 25)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvcodec"
MAX_LINES = 500
MODULES = sorted([*ROOT.glob("integrations/**/*.py"), *ROOT.glob("store/**/*.py")])


def test_the_walk_finds_the_modules() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in MODULES}
    assert {"integrations/vllm/connector.py", "store/directory.py", "store/redis.py"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_module_is_at_most_500_lines(path: Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_LINES})"

"""The import rules of ARCHITECTURE.md hold, and ``make lint`` (dev/check_imports.py) catches a breach.

Each breach is injected into a copy of the package; the check must fail on
the copy and name the injected import, which the untouched copy does not show.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.paths import REPO_ROOT

CHECKER = REPO_ROOT / "dev" / "check_imports.py"


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_imports", CHECKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _run(root: Path, *checks: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(CHECKER), "--root", str(root), *checks]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A copy of the package (Python sources + pyproject.toml) and what the checker says about it."""
    root = tmp_path_factory.mktemp("pristine")
    _copy_package(root)
    proc = _run(root)
    return root, proc.stdout + proc.stderr


def _copy_package(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "csrc")
    for folder in ("kvcodec", "kernels"):
        shutil.copytree(REPO_ROOT / folder, dest / folder, ignore=ignore)
    shutil.copyfile(REPO_ROOT / "pyproject.toml", dest / "pyproject.toml")


def _inject(tmp_path: Path, rel: str, line: str) -> Path:
    root = tmp_path / "injected"
    _copy_package(root)
    with (root / rel).open("a") as f:
        f.write(f"\n{line}\n")
    return root


# (file, injected line, what the check must then report)
BREACHES = [
    pytest.param(
        "kvcodec/format/dtypes.py",
        "from kvcodec.codec import encode  # noqa",
        "kvcodec.format.dtypes -> kvcodec.codec",
        id="format-imports-codec",
    ),
    pytest.param(
        "kvcodec/numerics.py",
        "from .backends import select  # noqa",
        "kvcodec.numerics -> kvcodec.backends",
        id="numerics-imports-backends",
    ),
    pytest.param(
        "kvcodec/format/crc.py",
        "import torch  # noqa",
        "kvcodec.format.crc -> torch",
        id="format-imports-torch",
    ),
    pytest.param(
        "kvcodec/codec/layout.py",
        "import kvcodec.kernels  # noqa",
        "kvcodec.codec.layout -> kvcodec.kernels",
        id="codec-imports-kernels",
    ),
    pytest.param(
        "kvcodec/store/directory.py",
        "from kvcodec import encode  # noqa",
        "kvcodec.store.directory -> kvcodec",
        id="store-imports-the-facade",
    ),
]


@pytest.mark.parametrize(("rel", "line", "reported"), BREACHES)
def test_an_upward_import_fails_the_layering_check(
    baseline: tuple[Path, str], tmp_path: Path, rel: str, line: str, reported: str
) -> None:
    assert reported not in baseline[1]
    proc = _run(_inject(tmp_path, rel, line), "layers")
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert reported in proc.stdout, proc.stdout + proc.stderr


def test_a_private_name_import_fails_the_private_check(baseline: tuple[Path, str], tmp_path: Path) -> None:
    line = "from kvcodec.format.header import _check_writable_header  # noqa"
    reported = "kvcodec.numerics (line"
    assert "imports private name _check_writable_header" not in baseline[1]
    proc = _run(_inject(tmp_path, "kvcodec/numerics.py", line), "private")
    assert proc.returncode != 0
    assert reported in proc.stdout and "_check_writable_header from kvcodec.format.header" in proc.stdout


def test_reading_a_private_attribute_of_an_imported_module_is_reported(tmp_path: Path) -> None:
    check = _checker()
    root = _inject(
        tmp_path, "kvcodec/store/directory.py", "from ..format import header as fh\n_LIMIT = fh._hash_pairs"
    )
    found = check.private_name_violations(check.Package.from_repo(root))
    assert any("kvcodec.store" in v and "_hash_pairs of kvcodec.format.header" in v for v in found), found


def test_private_modules_inside_their_package_are_allowed(tmp_path: Path) -> None:
    check = _checker()
    root = _inject(tmp_path, "kvcodec/hostmem.py", "from . import _cpu  # noqa")
    found = check.private_name_violations(check.Package.from_repo(root))
    assert not [v for v in found if v.startswith("kvcodec.hostmem")], found


def test_the_checker_sees_the_package_as_installed() -> None:
    check = _checker()
    pkg = check.Package.from_repo(REPO_ROOT)
    assert pkg.modules["kvcodec.kernels"] == REPO_ROOT / "kernels" / "__init__.py"
    assert pkg.modules["kvcodec.format.parser"] == REPO_ROOT / "kvcodec" / "format" / "parser.py"
    assert "kvcodec._cpu" in pkg.extensions


def test_the_package_keeps_its_import_rules(baseline: tuple[Path, str]) -> None:
    proc = _run(REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_a_script_reading_a_private_name_of_the_package_is_reported(tmp_path: Path) -> None:
    check = _checker()
    root = tmp_path / "repo"
    _copy_package(root)
    (root / "dev").mkdir()
    (root / "dev" / "tool.py").write_text("from kvcodec.format.parser import _Reader\n")
    found = check.private_name_violations(check.Package.from_repo(root), check.scripts(root))
    assert found == ["dev.tool (line 1) imports private name _Reader from kvcodec.format.parser"]

"""kvcodec's import rules, checked: the layering contracts and "no private names across modules".

Two checks, standard library + import-linter only (no torch, nothing imported from kvcodec):

- ``layers``: runs ``lint-imports`` with the contracts in ``pyproject.toml`` over a staged
  copy of the package as it is installed. ``kernels/`` is installed as ``kvcodec.kernels``
  (``[tool.setuptools.package-dir]``), a mapping import-linter cannot see in the source
  tree, so the Python files are copied into one tree first.
- ``private``: no module imports another module's underscore names, neither
  ``from kvcodec.x import _y`` nor ``x._y`` on a kvcodec module bound by an import
  (the package's modules, and the scripts in ``dev/`` and ``bench/`` for what they use of it).
  Underscore *modules* (``kvcodec._cpu``, ``kvcodec.kernels._tl``) are the ``private_modules``
  contract's business: importable from inside their own package only.

``python dev/check_imports.py [--root REPO] [layers|private ...]``: exit status 1 when a
rule is broken, each violation printed on its own line.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter brings tomli
    import tomli as tomllib

__all__ = ["Package", "main", "private_name_violations", "run_lint_imports", "stage"]

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Package:
    """The installed package: module name -> source file, plus compiled extension modules."""

    modules: dict[str, Path]
    extensions: frozenset[str]

    @classmethod
    def from_repo(cls, root: Path) -> Package:
        """Every module of ``root``'s package, named as installed (package-dir mapping applied)."""
        config = tomllib.loads((root / "pyproject.toml").read_text())
        tool = config.get("tool", {}).get("setuptools", {})
        dirs = {"kvcodec": "kvcodec", **tool.get("package-dir", {})}
        modules: dict[str, Path] = {}
        for package, folder in sorted(dirs.items()):
            for path in sorted((root / folder).rglob("*.py")):
                rel = path.relative_to(root / folder).with_suffix("")
                parts = [p for p in rel.parts if p != "__init__"]
                name = ".".join([package, *parts])
                if name not in modules or package != "kvcodec":  # a mapped folder wins over a stray copy
                    modules[name] = path
        extensions = frozenset(ext["name"] for ext in tool.get("ext-modules", []))
        return cls(modules, extensions)

    def is_module(self, name: str) -> bool:
        return name in self.modules or name in self.extensions

    def is_package(self, name: str) -> bool:
        path = self.modules.get(name)
        return path is not None and path.name == "__init__.py"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(pkg: Package, importer: str, module: str | None, level: int) -> str:
    """The absolute name of ``from <level dots><module> import ...`` inside ``importer``."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not pkg.is_package(importer):
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _check_from(pkg: Package, importer: str, node: ast.ImportFrom) -> Iterator[str]:
    source = _resolve(pkg, importer, node.module, node.level)
    if not source.startswith("kvcodec"):
        return
    for alias in node.names:
        if not _is_private(alias.name):
            continue
        if not pkg.is_module(f"{source}.{alias.name}"):  # modules: the private_modules contract
            yield f"imports private name {alias.name} from {source}"


def _module_bindings(pkg: Package, importer: str, tree: ast.Module) -> dict[str, str]:
    """Local names bound to kvcodec modules by this file's imports (``import a.b as x``, ``from a import b``)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kvcodec") and alias.asname:
                    bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(pkg, importer, node.module, node.level)
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if source.startswith("kvcodec") and pkg.is_module(target):
                    bound[alias.asname or alias.name] = target
    return bound


def _check_attributes(pkg: Package, importer: str, tree: ast.Module) -> Iterator[str]:
    bound = _module_bindings(pkg, importer, tree)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and _is_private(node.attr)
            and not pkg.is_module(f"{bound[node.value.id]}.{node.attr}")
        ):
            yield f"line {node.lineno}: reads private name {node.attr} of {bound[node.value.id]}"


SCRIPT_DIRS = ("dev", "bench")
"""Folders of scripts outside the package that use it: held to the same rule."""


def scripts(root: Path) -> dict[str, Path]:
    """The Python files of :data:`SCRIPT_DIRS`, named ``dev.x`` / ``bench.y`` (they import kvcodec absolutely)."""
    found = {}
    for folder in SCRIPT_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            found[".".join(path.relative_to(root).with_suffix("").parts)] = path
    return found


def private_name_violations(pkg: Package, extra: dict[str, Path] | None = None) -> list[str]:
    """One line per import (or attribute read) of another module's underscore name.

    The package's modules are checked, and ``extra`` files (scripts) for their imports of the package.
    """
    out: list[str] = []
    for importer, path in sorted({**pkg.modules, **(extra or {})}.items()):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                out += [f"{importer} (line {node.lineno}) {msg}" for msg in _check_from(pkg, importer, node)]
        out += [f"{importer} {msg}" for msg in _check_attributes(pkg, importer, tree)]
    return out


def stage(pkg: Package, dest: Path) -> Path:
    """Copy the package's Python files into ``dest`` laid out as installed; return ``dest``.

    Each compiled extension gets an empty stand-in, so that ``from .. import _cpu`` reads as an
    import of ``kvcodec._cpu`` rather than of the package.
    """
    for name, path in pkg.modules.items():
        parts = name.split(".")
        target = dest.joinpath(*parts[:-1], parts[-1] + ".py")
        if path.name == "__init__.py":
            target = dest.joinpath(*parts, "__init__.py")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    for name in pkg.extensions:  # compiled modules: an empty stand-in, so their imports read as such
        parts = name.split(".")
        dest.joinpath(*parts[:-1], parts[-1] + ".py").write_text('"""A compiled extension module."""\n')
    return dest


def run_lint_imports(root: Path) -> int:
    """lint-imports over a staged copy of ``root``'s package, with ``root``'s contracts; its exit status."""
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = [str(exe) if exe.exists() else "lint-imports", "--no-cache", str(root / "pyproject.toml")]
    with tempfile.TemporaryDirectory(prefix="kvcodec-lint-") as tmp:
        staged = stage(Package.from_repo(root), Path(tmp))
        env = {**os.environ, "PYTHONPATH": str(staged)}
        return subprocess.run(cmd, cwd=staged, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO, help="repository root (default: this checkout)")
    parser.add_argument("checks", nargs="*", help="layers and/or private (default: both)")
    args = parser.parse_args(argv)
    args.checks = args.checks or ["layers", "private"]
    unknown = set(args.checks) - {"layers", "private"}
    if unknown:
        parser.error(f"unknown checks {sorted(unknown)}; expected layers and/or private")
    failed = False
    if "private" in args.checks:
        violations = private_name_violations(Package.from_repo(args.root), scripts(args.root))
        for line in violations:
            print(f"private-name: {line}")
        print(f"private names: {len(violations)} violation(s)")
        failed |= bool(violations)
    if "layers" in args.checks:
        sys.stdout.flush()
        failed |= run_lint_imports(args.root) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

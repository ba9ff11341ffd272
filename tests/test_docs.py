"""README.md and docs/*.md say what works: every Python block runs, every command names a real target.

Each ```python block runs in a fresh namespace inside a temp dir. A block that needs more than the
default install carries a marker on the line before its fence: ``<!-- needs: redis -->`` blocks run
here against a fresh redis-server (``127.0.0.1:6379`` in the block is rewritten to its port);
``<!-- needs: vllm -->`` blocks run in vLLM's venv (``NEEDS`` says where) and are skipped here with
that reason, never silently. The README stays a newcomer's page: at most 10 KiB.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from tests.paths import REPO_ROOT

README = REPO_ROOT / "README.md"
README_MAX_BYTES = 10 * 1024
DOCS = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]
VLLM_DOCS_TEST = REPO_ROOT / "tests" / "integrations" / "vllm" / "test_docs_vllm.py"

NEEDS = {
    "redis": "runs here against a fresh redis-server on a free port of 127.0.0.1",
    "vllm": f"needs vLLM: run in .venv-vllm by {VLLM_DOCS_TEST.relative_to(REPO_ROOT)}",
}
"""What a marked block needs -> where it runs (for ``vllm``, the skip reason here)."""
REDIS_URL_IN_DOCS = "127.0.0.1:6379"

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
_MARKER = re.compile(r"<!--\s*needs:\s*([\w-]+)\s*-->")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a document."""

    path: Path
    line: int
    lang: str
    code: str
    needs: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO_ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path``, each with the ``needs`` marker on the line before it, if any."""
    text = path.read_text()
    found = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.search(before)
        line = text.count("\n", 0, m.start()) + 1
        found.append(Block(path, line, m.group(1), m.group(2), marker.group(1) if marker else None))
    return found


ALL_BLOCKS = [b for path in DOCS for b in blocks(path)]
PYTHON = [b for b in ALL_BLOCKS if b.lang == "python"]


def _restore_lmcache(saved: dict) -> None:
    """Undo what a block's ``compat.install()`` put into ``sys.modules`` (other tests import LMCache)."""
    for name in [n for n in sys.modules if n == "lmcache" or n.startswith("lmcache.")]:
        del sys.modules[name]
    sys.modules.update(saved)


def run_block(block: Block, cwd: Path, monkeypatch: pytest.MonkeyPatch, ns: dict | None = None) -> dict:
    """Execute ``block`` in ``cwd`` with a fresh namespace (plus ``ns``); the namespace after it."""
    monkeypatch.chdir(cwd)
    saved = {n: m for n, m in sys.modules.items() if n == "lmcache" or n.startswith("lmcache.")}
    namespace = {"__name__": "__doc_block__", **(ns or {})}
    try:
        exec(compile(block.code, block.name, "exec"), namespace)
    finally:
        _restore_lmcache(saved)
    return namespace


def test_readme_fits_a_newcomer() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; at most {README_MAX_BYTES}"


def test_docs_have_python_examples() -> None:
    assert sum(b.path == README for b in PYTHON) >= 1
    assert len(PYTHON) >= 6, [b.name for b in PYTHON]


def test_every_marker_names_a_known_need() -> None:
    bad = [f"{b.name}: needs {b.needs!r}" for b in ALL_BLOCKS if b.needs is not None and b.needs not in NEEDS]
    assert not bad, f"unknown needs (known: {sorted(NEEDS)}): {bad}"
    assert all(b.lang == "python" for b in ALL_BLOCKS if b.needs), "needs markers belong on python blocks"
    if any(b.needs == "vllm" for b in ALL_BLOCKS):
        assert VLLM_DOCS_TEST.is_file()


@pytest.mark.parametrize("block", PYTHON, ids=[b.name for b in PYTHON])
def test_python_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.needs == "redis":
        _run_with_redis(block, tmp_path, monkeypatch)
    elif block.needs is not None:
        pytest.skip(NEEDS[block.needs])
    else:
        run_block(block, tmp_path, monkeypatch)


def _run_with_redis(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.redis_servers import redis_missing, redis_single

    assert REDIS_URL_IN_DOCS in block.code, f"{block.name}: a redis block names {REDIS_URL_IN_DOCS}"
    if (why := redis_missing()) is not None:
        pytest.skip(f"needs a Redis server: {why}")
    with redis_single(tmp_path) as server:
        code = block.code.replace(REDIS_URL_IN_DOCS, f"127.0.0.1:{server.port}")
        run_block(replace(block, code=code), tmp_path, monkeypatch)


# ----------------------------------------------------------------------------
# Commands: make targets and kvcodec subcommands named in the docs exist
# ----------------------------------------------------------------------------

_MAKE_REF = re.compile(r"(?<![\w/.-])make ((?:[a-z][\w-]*)(?: [a-z][\w-]*)*)")
_TARGET = re.compile(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", re.M)
_CLI_LINE = re.compile(r"^(?:\.venv/bin/)?kvcodec (\w+)(.*)$", re.M)


def make_targets() -> set[str]:
    """Every target defined in the Makefile and mk/*.mk."""
    files = [REPO_ROOT / "Makefile", *sorted((REPO_ROOT / "mk").glob("*.mk"))]
    return {t for f in files for t in _TARGET.findall(f.read_text())}


def _code_text(path: Path) -> str:
    """Fenced blocks and inline code spans of ``path``: where commands are written."""
    text = path.read_text()
    return "\n".join([b.code for b in blocks(path)] + re.findall(r"`([^`\n]+)`", _FENCE.sub("", text)))


def test_every_make_target_named_exists() -> None:
    targets = make_targets()
    missing = []
    for path in [*DOCS, REPO_ROOT / "bench" / "README.md"]:
        for m in _MAKE_REF.finditer(_code_text(path)):
            words = [w for w in m.group(1).split() if not w.isupper()]
            missing += [f"{path.name}: make {w}" for w in words[:1] if w not in targets]
    assert not missing, missing


def _cli_lines() -> list[tuple[str, str, str]]:
    """``(doc, subcommand, rest of line)`` for each kvcodec command line in a shell block."""
    found = []
    for path in DOCS:
        for b in blocks(path):
            if b.lang == "sh":
                found += [(b.name, m.group(1), m.group(2)) for m in _CLI_LINE.finditer(b.code)]
    return found


def test_every_kvcodec_command_and_flag_named_exists() -> None:
    lines = _cli_lines()
    assert lines
    helps: dict[str, str] = {}
    wrong = []
    for name, cmd, rest in lines:
        if cmd not in helps:
            proc = subprocess.run(
                [sys.executable, "-m", "kvcodec.tools.cli", cmd, "--help"], capture_output=True, text=True
            )
            helps[cmd] = proc.stdout if proc.returncode == 0 else ""
        if not helps[cmd]:
            wrong.append(f"{name}: kvcodec {cmd}")
            continue
        code = rest.split("#", 1)[0]
        wrong += [f"{name}: kvcodec {cmd} {f}" for f in re.findall(r"--[\w-]+", code) if f not in helps[cmd]]
    assert not wrong, wrong


def _transfer_configs() -> list[tuple[str, dict]]:
    """``(block, config)`` for each ``--kv-transfer-config '<json>'`` in a shell block."""
    found = []
    for path in DOCS:
        for b in blocks(path):
            if b.lang == "sh":
                found += [
                    (b.name, json.loads(j)) for j in re.findall(r"--kv-transfer-config '(.*?)'", b.code, re.S)
                ]
    return found


def test_every_kvcodec_connector_config_shown_is_accepted() -> None:
    from kvcodec.integrations.vllm.config import KvcodecConfig

    ours = [(name, cfg) for name, cfg in _transfer_configs() if cfg["kv_connector"] == "KvcodecConnector"]
    assert ours
    for name, cfg in ours:
        assert cfg["kv_connector_module_path"] == "kvcodec.integrations.vllm", name
        assert cfg["kv_role"] == "kv_both", name
        KvcodecConfig.from_extra(cfg["kv_connector_extra_config"])


def test_vllm_doc_lists_every_connector_key() -> None:
    """docs/vllm.md's key tables name every field of the connector's config, and nothing else."""
    from kvcodec.integrations.vllm.config import KvcodecConfig

    text = (REPO_ROOT / "docs" / "vllm.md").read_text()
    documented = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
    assert documented == set(KvcodecConfig.__dataclass_fields__)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of ``path``: lower case, punctuation dropped, spaces as dashes."""
    heads = re.findall(r"^#+ (.+)$", _FENCE.sub("", path.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_every_relative_link_resolves() -> None:
    broken = []
    for path in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", path.read_text()):
            if "://" in target:
                continue
            dest = path.parent / target if target else path
            if not dest.is_file() or (anchor and anchor not in _anchors(dest)):
                broken.append(f"{path.relative_to(REPO_ROOT)} -> {target}#{anchor}")
    assert not broken, broken


def test_benchmarks_doc_names_every_ci_step() -> None:
    """docs/benchmarks.md "What CI runs" names each make target .ci/run runs, in order."""
    ci = re.findall(r"^make ([\w-]+)", (REPO_ROOT / ".ci" / "run").read_text(), re.M)
    section = (
        (REPO_ROOT / "docs" / "benchmarks.md").read_text().split("## What CI runs", 1)[1].split("\n## ", 1)[0]
    )
    named = re.findall(r"`make\s+([\w-]+)`", section)
    assert ci[0] == "install" and named == ci[1:], (named, ci)

"""``quality --model`` / ``demo --model`` on malformed checkpoints: the documented refusal, never a crash.

Each folder is a working tiny Llama (built here) with one thing broken. Every case must end in the
"could not be loaded" line naming the file and the reason (exit 1), not the CLI's "unexpected <Type>"
handler, and pickle weights must never be unpickled.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest

from kvcodec.tools.cli import main
from tests.tools.test_quality import SMALL_RUN, build_tiny_llama, write_texts


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_texts(tmp_path_factory.mktemp("texts"))[0]


@pytest.fixture
def broken(tiny_model: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model to break."""
    return Path(shutil.copytree(tiny_model, tmp_path / "model"))


class _WritesAFile:
    """Unpickling this opens (creates) ``path``: proof that a pickle ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], *words: str) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could not be loaded" in err, err
    assert "unexpected" not in err and "Traceback" not in err, err
    for word in words:
        assert word in err, err


def _quality(model: Path, text: str) -> list[str]:
    return ["quality", "--model", str(model), "--text", text, *SMALL_RUN]


def test_config_holding_a_list(broken: Path, text: str, capsys) -> None:
    (broken / "config.json").write_text("[]")
    _refused(_quality(broken, text), capsys, "config.json", "expected an object")


def test_config_not_json(broken: Path, text: str, capsys) -> None:
    (broken / "config.json").write_bytes(b"\xff{")
    _refused(_quality(broken, text), capsys, "config.json", "not valid JSON")


def test_safetensors_header_length_2_to_the_62(broken: Path, text: str, capsys) -> None:
    weights = broken / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[:8] = (1 << 62).to_bytes(8, "little")
    weights.write_bytes(data)
    _refused(_quality(broken, text), capsys, "model.safetensors", f"header length {1 << 62}")


def test_safetensors_truncated_data(broken: Path, text: str, capsys) -> None:
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    _refused(_quality(broken, text), capsys, str(broken))


def test_pickle_weights_are_never_unpickled(broken: Path, text: str, tmp_path: Path, capsys) -> None:
    probe = tmp_path / "probe-ran"
    pickle.loads(pickle.dumps(_WritesAFile(probe)))
    assert probe.exists()  # the payload is live: unpickling it creates its file
    ran = tmp_path / "payload-ran"
    (broken / "model.safetensors").unlink()
    (broken / "pytorch_model.bin").write_bytes(pickle.dumps(_WritesAFile(ran)))
    _refused(_quality(broken, text), capsys, "pytorch_model.bin", "pickle")
    assert not ran.exists()


def test_pickle_beside_safetensors_is_left_alone(broken: Path, text: str, tmp_path: Path) -> None:
    """A folder with both loads its safetensors weights; the pickle is never opened."""
    ran = tmp_path / "payload-ran"
    (broken / "pytorch_model.bin").write_bytes(pickle.dumps(_WritesAFile(ran)))
    assert main([*_quality(broken, text), "--greedy", "0", "--scopes", "per_tensor"]) in (0, 1)
    assert not ran.exists()


def test_demo_refuses_the_same_way(broken: Path, text: str, capsys) -> None:
    (broken / "config.json").write_text("[]")
    argv = ["demo", "--model", str(broken), "--text", text, "--tokens", "64", "--no-progress"]
    _refused(argv, capsys, "config.json")

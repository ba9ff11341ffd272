"""select's CPU memo answers exactly as a fresh resolution: the environment is still read every call."""

from __future__ import annotations

import pytest
import torch

from kvcodec.backends import select
from kvcodec.errors import UnsupportedConfigError

CPU = torch.device("cpu")


def test_memo_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCODEC_BACKEND", raising=False)
    first = select(None, CPU)
    assert select(None, CPU) is first is select(None, "cpu")
    monkeypatch.setenv("KVCODEC_BACKEND", "torch")
    assert select(None, CPU).name == "torch"
    monkeypatch.setenv("KVCODEC_BACKEND", "bogus")
    with pytest.raises(UnsupportedConfigError):
        select(None, CPU)
    assert select("torch", CPU).name == "torch"  # an explicit name wins over the environment


def test_triton_on_cpu_is_not_memoized(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    try:
        assert select("triton", CPU).name == "triton"
    except UnsupportedConfigError:
        pytest.skip("triton is not installed")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(UnsupportedConfigError, match="TRITON_INTERPRET"):
        select("triton", CPU)


@pytest.mark.parametrize("bad", [5, ["cpu"]])
def test_a_name_that_is_not_a_string_is_still_refused(bad: object) -> None:
    with pytest.raises(UnsupportedConfigError):
        select(bad, CPU)  # type: ignore[arg-type]

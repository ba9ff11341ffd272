"""The backend seam: selection, explicit fallback, and what backend_info reports."""

from __future__ import annotations

import pytest
import torch

import kvcodec
from kvcodec import backends
from kvcodec.backends import Declined, Groups, call, reference_backend, select
from kvcodec.errors import UnsupportedConfigError
from kvcodec.format import ScaleScope


def _cpu_available() -> bool:
    from kvcodec.backends import cpu

    return cpu.AVAILABLE


def test_auto_picks_the_c_loops_on_cpu_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCODEC_BACKEND", raising=False)
    want = "cpu" if _cpu_available() else "torch"
    assert select("auto", "cpu").name == want
    assert select(None, "cpu").name == want
    assert kvcodec.backend_info("cpu")["auto"] == want


def test_env_and_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCODEC_BACKEND", "torch")
    assert select(None, "cpu").name == "torch"
    assert select("reference", "cpu").name == "torch"
    if _cpu_available():
        assert select("native", "cpu").name == "cpu"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("KVCODEC_BACKEND", "triton")
    with pytest.raises(UnsupportedConfigError, match="TRITON_INTERPRET"):
        select(None, "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select(None, "cpu").name == "triton"


@pytest.mark.parametrize("bad", ["bogus", "cuda:x"])
def test_unknown_backend_or_device_is_a_config_error(bad: str) -> None:
    with pytest.raises(UnsupportedConfigError):
        select(bad, "cpu") if bad == "bogus" else select("torch", bad)


def test_cpu_backend_refuses_other_devices() -> None:
    with pytest.raises(UnsupportedConfigError, match="cpu"):
        select("cpu", "meta")


class _Declining:
    name = "declining"

    def __init__(self) -> None:
        self.calls = 0

    def quantize(self, *args: object, **kwargs: object) -> None:
        self.calls += 1
        raise Declined("test: cannot serve this")


def test_a_declined_call_runs_the_reference_and_is_reported() -> None:
    v = torch.randn(8, 2, 4)
    groups = Groups(ScaleScope.PER_TENSOR)
    s = torch.tensor(0.01)
    want = reference_backend().quantize(v, s, groups, out=torch.empty(8, 2, 4, dtype=torch.float8_e4m3fn))
    be = _Declining()
    got = call(be, "quantize", v, s, groups, out=torch.empty(8, 2, 4, dtype=torch.float8_e4m3fn))
    assert be.calls == 1
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    falls = backends.backend_info()["fallbacks"]
    assert any(f["backend"] == "declining" and f["reason"] == "test: cannot serve this" for f in falls)


def test_backend_info_names_why_a_backend_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    info = kvcodec.backend_info("cpu")
    assert info["available"]["torch"] is True
    assert info["available"]["triton"] is False
    assert "TRITON_INTERPRET" in info["unavailable_reasons"]["triton"]

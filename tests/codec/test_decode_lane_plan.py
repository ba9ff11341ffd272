"""decode's lane plan (kvcodec.codec.decode._lane): the checks of a decode into ``out_k`` and a
dequantized ``out_v`` are remembered per thread for one header layout and two outputs (their addresses
and metadata), and redone whenever any of them changes. A remembered plan never lets a decode through
that the checks refuse, never lands V or K anywhere else, and gives the bytes a fresh check gives."""

from __future__ import annotations

import importlib
import threading

import pytest
import torch

import kvcodec
from kvcodec import UnsupportedConfigError
from kvcodec.errors import Reason
from tests.raises import raises_reason

dec = importlib.import_module("kvcodec.codec.decode")

SHAPE = (32, 2, 16)


def _blob(*, lossless: bool = True, scope: str = "per_page_head", dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k, v = ((torch.randn(*SHAPE, generator=g) * 3).to(dtype) for _ in range(2))
    opts = {"scope": scope, "page_size": 8} if scope == "per_page_head" else {"scope": scope}
    return kvcodec.encode(k, v, compression="lossless" if lossless else "none", **opts)


@pytest.fixture
def checks(monkeypatch) -> list[int]:
    """Counts the full checks (``_request``) a decode runs; the thread's plan forgotten first."""
    monkeypatch.setattr(dec._plans, "last", None, raising=False)
    seen: list[int] = []
    request = dec._request
    monkeypatch.setattr(dec, "_request", lambda *a, **kw: seen.append(1) or request(*a, **kw))
    return seen


def _outs(dtype=torch.bfloat16, v_dtype=torch.float32):
    return torch.empty(SHAPE, dtype=dtype), torch.empty(SHAPE, dtype=v_dtype)


def _same(got, want) -> None:
    assert torch.equal(got.k.view(torch.uint8), want.k.view(torch.uint8))
    assert torch.equal(got.v.view(torch.uint8), want.v.view(torch.uint8))


@pytest.mark.parametrize("lossless", [True, False], ids=["lossless", "plain"])
def test_the_same_outputs_and_layout_are_checked_once(checks, lossless) -> None:
    blobs = [_blob(lossless=lossless, seed=s) for s in range(3)]
    out_k, out_v = _outs()
    for b in blobs:
        _same(kvcodec.decode(b, out_k=out_k, out_v=out_v), kvcodec.decode(b, out_v_dtype=torch.float32))
    assert len(checks) == 1 + 3  # the first decode into them; the three references decode without outputs


def test_another_output_layout_or_dtype_is_checked_again(checks) -> None:
    out_k, out_v = _outs()
    kvcodec.decode(_blob(), out_k=out_k, out_v=out_v)
    other_k, other_v = _outs(v_dtype=torch.float16)
    for b, ok, ov in (
        (_blob(), other_k, out_v),  # another out_k (address)
        (_blob(), other_k, other_v),  # another out_v dtype
        (_blob(scope="per_layer_head"), other_k, other_v),  # another scale layout
        (_blob(dtype=torch.float16), torch.empty(SHAPE, dtype=torch.float16), other_v),  # another K dtype
    ):
        n = len(checks)
        _same(kvcodec.decode(b, out_k=ok, out_v=ov), kvcodec.decode(b, out_v_dtype=ov.dtype))
        assert len(checks) == n + 2


def test_an_output_changed_in_place_is_refused_as_before(checks) -> None:
    """The same tensors, changed after a decode stored their plan: grad, a view that aliases the other
    output, a reshape: each refused (or served) exactly as a fresh check decides."""
    blob = _blob()
    out_k, out_v = _outs()
    kvcodec.decode(blob, out_k=out_k, out_v=out_v)
    out_v.requires_grad_(True)
    with raises_reason(UnsupportedConfigError, Reason.BAD_OUTPUT):
        kvcodec.decode(blob, out_k=out_k, out_v=out_v)
    out_v.requires_grad_(False)
    kvcodec.decode(blob, out_k=out_k, out_v=out_v)
    both = torch.empty(SHAPE, dtype=torch.bfloat16)
    with raises_reason(UnsupportedConfigError, Reason.OVERLAP):
        kvcodec.decode(blob, out_k=both, out_v=both)
    out_v.resize_(SHAPE[0] // 2, SHAPE[1], SHAPE[2])  # the same storage, half the tokens
    with raises_reason(UnsupportedConfigError, Reason.BAD_SHAPE):
        kvcodec.decode(blob, out_k=out_k, out_v=out_v)


def test_a_backend_switched_by_the_environment_is_taken(checks, monkeypatch) -> None:
    blob = _blob()
    out_k, out_v = _outs()
    want = kvcodec.decode(blob, out_k=out_k, out_v=out_v)
    want = (want.k.clone(), want.v.clone())
    monkeypatch.setenv("KVCODEC_BACKEND", "torch")
    n = len(checks)
    got = kvcodec.decode(blob, out_k=out_k, out_v=out_v)
    assert len(checks) == n + 1 and torch.equal(got.k, want[0]) and torch.equal(got.v, want[1])


@pytest.mark.parametrize("lossless", [True, False], ids=["lossless", "plain"])
def test_a_blob_lying_under_a_remembered_output_is_served_as_without_a_plan(checks, lossless) -> None:
    """The outputs' plan is kept, but each blob is checked against them, as a fresh check does: a plain
    blob whose payload is out_k's own memory is refused (OVERLAP); a lossless one is read whole before
    out_k is written (its plain payload lies in the thread's buffer), so it decodes as from a copy."""
    blob = _blob(lossless=lossless)
    want = kvcodec.decode(bytes(blob), out_v_dtype=torch.float32)
    room = torch.zeros(len(blob) + 64, dtype=torch.uint8)
    out_k = room[64 : 64 + 2 * torch.Size(SHAPE).numel()].view(torch.bfloat16).view(SHAPE)
    out_v = torch.empty(SHAPE)
    kvcodec.decode(blob, out_k=out_k, out_v=out_v)  # the blob elsewhere: served, the plan kept
    room.numpy()[: len(blob)] = memoryview(blob)  # now the blob lies under out_k
    lying = memoryview(room.numpy())[: len(blob)]
    if not lossless:
        with raises_reason(UnsupportedConfigError, Reason.OVERLAP):
            kvcodec.decode(lying, out_k=out_k, out_v=out_v)
        return
    _same(kvcodec.decode(lying, out_k=out_k, out_v=out_v), want)


def test_each_thread_keeps_its_own_plan(checks) -> None:
    blob = _blob()
    outs = [_outs() for _ in range(2)]
    want = kvcodec.decode(blob, out_v_dtype=torch.float32)

    def run(i: int) -> bool:
        got = [kvcodec.decode(blob, out_k=outs[i][0], out_v=outs[i][1]) for _ in range(20)]
        return all(torch.equal(g.v, want.v) and torch.equal(g.k, want.k) for g in got)

    threads = [threading.Thread(target=lambda i=i: results.append(run(i))) for i in range(2)]
    results: list[bool] = []
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True, True]

"""PendingBytes: the byte bound on gathered, unwritten saves (no vLLM needed)."""

from __future__ import annotations

import threading

from kvcodec.integrations.vllm.pending import PendingBytes


def test_a_wait_is_reported_when_it_begins_not_when_it_ends() -> None:
    pending = PendingBytes(limit=10)
    assert pending.take(8) is True
    began = threading.Event()
    result: list[bool | None] = []
    waiter = threading.Thread(target=lambda: result.append(pending.take(8, on_wait=began.set)))
    waiter.start()
    assert began.wait(30), "the waiter never reported its wait"
    assert result == [] and pending.held == 8  # still waiting, already counted
    pending.give(8)
    waiter.join(30)
    assert result == [False] and pending.held == 8


def test_a_take_that_fits_never_reports_a_wait() -> None:
    pending = PendingBytes(limit=10)
    calls: list[int] = []
    assert pending.take(4, on_wait=lambda: calls.append(1)) is True
    assert pending.take(6, on_wait=lambda: calls.append(1)) is True
    assert calls == [] and pending.held == 10


def test_close_ends_a_wait_with_nothing_taken() -> None:
    pending = PendingBytes(limit=1)
    assert pending.take(1) is True
    began = threading.Event()
    result: list[bool | None] = []
    waiter = threading.Thread(target=lambda: result.append(pending.take(1, on_wait=began.set)))
    waiter.start()
    assert began.wait(30)
    pending.close()
    waiter.join(30)
    assert result == [None] and pending.held == 1

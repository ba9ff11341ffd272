"""The connector's background pool: bounded, lazy threads, drained or abandoned at shutdown (no vLLM needed)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvcodec.integrations.vllm.background import BackgroundPool


def test_no_thread_before_the_first_job() -> None:
    before = threading.active_count()
    pool = BackgroundPool("t", threads=3, capacity=4)
    assert threading.active_count() == before and pool.depth == 0
    done = threading.Event()
    assert pool.submit(done.set)
    assert done.wait(30)
    assert pool.wait_idle(30) and pool.depth == 0
    assert pool.shutdown(5) == 0


def test_a_full_pool_refuses_at_once() -> None:
    gate = threading.Event()
    pool = BackgroundPool("t", threads=1, capacity=2)
    assert pool.submit(lambda: gate.wait(30))
    assert pool.submit(lambda: None)
    # Full: refused, not queued behind the running job (which waits for the gate, opened only below).
    assert not pool.submit(lambda: None)
    assert pool.depth == 2
    gate.set()
    assert pool.wait_idle(30)
    assert pool.submit(lambda: None)
    pool.shutdown(5)


def test_shutdown_drains_then_abandons() -> None:
    ran = []
    pool = BackgroundPool("t", threads=1, capacity=8)
    for i in range(3):
        pool.submit(lambda i=i: ran.append(i))
    assert pool.shutdown(30) == 0 and ran == [0, 1, 2]
    assert not pool.submit(lambda: None)  # shut down: nothing more is taken

    gate = threading.Event()
    slow = BackgroundPool("t", threads=1, capacity=8)
    slow.submit(lambda: gate.wait(30))
    for _ in range(3):
        slow.submit(lambda: ran.append("late"))
    assert slow.shutdown(0.1) == 4  # the running job and the three queued
    gate.set()
    time.sleep(0.2)
    assert "late" not in ran


def test_a_failing_job_keeps_the_thread() -> None:
    pool = BackgroundPool("t", threads=1, capacity=4)
    ran = threading.Event()

    def boom() -> None:
        raise RuntimeError("disk on fire")

    pool.submit(boom)
    pool.submit(ran.set)
    assert ran.wait(30)
    pool.shutdown(5)


def test_pool_threads_run_below_the_engines_priority() -> None:
    if not hasattr(os, "getpriority"):
        pytest.skip("no per-thread priorities on this platform")
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = []
    pool = BackgroundPool("t", threads=1, capacity=1, nice=5)
    assert pool.submit(lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    assert pool.wait_idle(30)
    assert seen == [min(19, mine + 5)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller's is untouched
    pool.shutdown(5)

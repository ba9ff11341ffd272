"""The connector's read buffers: a bounded free list, each buffer handed out once at a time."""

from __future__ import annotations

from kvcodec.integrations.vllm.buffers import ReadBuffers


def test_empty_pool_has_nothing_to_take() -> None:
    pool = ReadBuffers(max_bytes=100)
    assert pool.take() is None and pool.idle_bytes == 0


def test_given_buffers_come_back_once_each() -> None:
    pool = ReadBuffers(max_bytes=100)
    a, b = bytearray(40), bytearray(50)
    pool.give([a, b])
    assert pool.idle_bytes == 90
    got = [pool.take(), pool.take()]
    assert {id(x) for x in got} == {id(a), id(b)}
    assert pool.take() is None and pool.idle_bytes == 0


def test_what_does_not_fit_under_the_bound_is_dropped() -> None:
    pool = ReadBuffers(max_bytes=100)
    pool.give([bytearray(60), bytearray(60), bytearray(30)])
    assert pool.idle_bytes == 90
    assert pool.take() is not None and pool.take() is not None and pool.take() is None


def test_lend_gives_an_idle_buffer_large_enough_else_one_of_its_own() -> None:
    pool = ReadBuffers(max_bytes=1000)
    small, big = bytearray(40), bytearray(400)
    pool.give([big, small])
    assert pool.lend(100) is big and pool.idle_bytes == 40  # the small one is left for another read
    fresh = pool.lend(100)
    assert len(fresh) == 100 and pool.owns(fresh) and not pool.owns(small) and not pool.owns(big)
    pool.give([fresh])
    assert pool.lend(50) is fresh  # the most recently given back first

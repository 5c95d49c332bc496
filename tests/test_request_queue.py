"""The request queue: one request at a time, in arrival order, re-entrant, robust to a waiter giving up."""

from __future__ import annotations

import threading

import pytest

from ov_kvcrush.serving.request_queue import RequestQueue


def _until(predicate) -> None:
    """Wait for another thread to reach a state (a condition, not a duration)."""
    done = threading.Event()
    while not predicate():
        done.wait(0.001)


def test_requests_are_served_one_at_a_time_in_arrival_order():
    q = RequestQueue()
    order, inside = [], []
    release = threading.Event()

    def request(name: str) -> None:
        with q.turn():
            inside.append(name)
            assert len(inside) == 1, "two requests served at once"
            if name == "first":
                release.wait(10)
            order.append(name)
            inside.pop()

    first = threading.Thread(target=request, args=("first",))
    first.start()
    _until(lambda: q.waiting == 0 and inside == ["first"])
    others = []
    for i in range(4):  # queued while the first is served, each after the previous has its ticket
        t = threading.Thread(target=request, args=(f"r{i}",))
        t.start()
        others.append(t)
        _until(lambda i=i: q.waiting == i + 1)
    release.set()
    for t in [first, *others]:
        t.join(10)
    assert order == ["first", "r0", "r1", "r2", "r3"]
    assert q.waiting == 0


def test_the_thread_being_served_may_call_in_again():
    q = RequestQueue()
    with q.turn():
        with q.turn():  # a pipeline method using another
            pass
        assert q.waiting == 0
    with q.turn():  # released once, by the outermost call
        pass


def test_a_waiter_that_gives_up_does_not_block_the_ones_behind():
    q = RequestQueue()
    served = []
    holding, hold = threading.Event(), threading.Event()

    def holder() -> None:
        with q.turn():
            holding.set()
            hold.wait(10)

    def later_request() -> None:
        with q.turn():
            served.append("later")

    t = threading.Thread(target=holder)
    t.start()
    holding.wait(10)
    with pytest.raises(TimeoutError, match=r"\(1 requests ahead\)"), q.turn(timeout=0.01):
        pass  # never reached: the holder keeps its turn
    later = threading.Thread(target=later_request)
    later.start()
    _until(lambda: q.waiting == 1)
    hold.set()
    t.join(10)
    later.join(10)
    assert served == ["later"] and q.waiting == 0

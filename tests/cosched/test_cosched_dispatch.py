"""The capacity dispatcher: placement by free slots, sessions kept and moved, FIFO waiting, bounded counts."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings, strategies as st

from slime_ascend.cosched.dispatch import CapacityDispatcher


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def run(coro):
    return asyncio.run(coro)


def test_free_slots_first_then_one_fifo_queue():
    async def main():
        d = CapacityDispatcher(1)
        d.set_engines(["a", "b"])
        first, second = await d.acquire(), await d.acquire()
        assert {first, second} == {"a", "b"}
        third = asyncio.create_task(d.acquire())
        fourth = asyncio.create_task(d.acquire())
        await asyncio.sleep(0)
        assert not third.done() and not fourth.done()
        d.release("b")
        await asyncio.sleep(0)
        assert third.done() and third.result() == "b" and not fourth.done()  # FIFO: the first waiter gets it
        d.release("a")
        await asyncio.sleep(0)
        assert fourth.result() == "a"

    run(main())


def test_a_session_stays_on_its_engine_while_it_has_room_and_moves_when_not():
    async def main():
        d = CapacityDispatcher(2)
        d.set_engines(["a", "b"])
        owner = await d.acquire("s")
        d.release(owner)
        assert await d.acquire("s") == owner  # back to its prefix
        assert await d.acquire("s") == owner  # still room (capacity 2)
        moved = await d.acquire("s")  # owner full: moved, counted
        assert moved != owner
        stats = d.take_stats()
        assert stats["rollout/cosched_moves"] == 1 and stats["rollout/cosched_requests"] == 4
        assert await d.acquire("s") == moved  # the new owner

    run(main())


def test_the_engine_with_most_free_slots_gets_a_request_without_session():
    async def main():
        d = CapacityDispatcher(3)
        d.set_engines(["a", "b"])
        assert [await d.acquire() for _ in range(4)] == ["a", "b", "a", "b"]

    run(main())


def test_busy_fraction_slot_use_and_waits_over_a_window():
    async def main():
        clock = Clock()
        d = CapacityDispatcher(2, clock=clock)
        d.set_engines(["a", "b"])
        url = await d.acquire()
        clock.t = 3.0
        d.release(url)
        clock.t = 4.0
        stats = d.take_stats()
        assert stats["rollout/cosched_engine0_busy_fraction"] == pytest.approx(0.75)
        assert stats["rollout/cosched_engine0_slot_use"] == pytest.approx(3.0 / (4.0 * 2))
        assert stats["rollout/cosched_engine1_busy_fraction"] == 0.0
        assert stats["rollout/cosched_busy_fraction_min"] == 0.0
        assert d.take_stats()["rollout/cosched_requests"] == 0.0  # a new window

    run(main())


def test_a_cancelled_waiter_leaves_the_queue_and_its_slot_is_not_lost():
    async def main():
        d = CapacityDispatcher(1)
        d.set_engines(["a"])
        held = await d.acquire()
        waiter = asyncio.create_task(d.acquire())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        d.release(held)
        assert await asyncio.wait_for(d.acquire(), 1) == "a"

    run(main())


def test_engines_leaving_and_joining():
    async def main():
        d = CapacityDispatcher(1)
        d.set_engines(["a"])
        held = await d.acquire()
        waiter = asyncio.create_task(d.acquire())
        await asyncio.sleep(0)
        d.set_engines(["b"])  # a is gone from the router: no new request for it; b joins and takes the waiter
        await asyncio.sleep(0)
        assert waiter.result() == "b"
        d.release(held)  # a's running request still releases
        assert d.engines == ["b"]
        with pytest.raises(ValueError, match="holds no slot"):
            d.release("a")

    run(main())


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        CapacityDispatcher(0)
    with pytest.raises(RuntimeError, match="no engine"):
        run(CapacityDispatcher(1).acquire())


@settings(max_examples=40, deadline=None)
@given(engines=st.integers(1, 4), capacity=st.integers(1, 3), n=st.integers(1, 40), seed=st.integers(0, 10**6))
def test_never_over_capacity_never_idle_while_requests_wait(engines, capacity, n, seed):
    """Whatever the arrival and finishing order: no engine runs more than its capacity, and a request waits only
    while every engine is full."""
    rng = random.Random(seed)
    urls = [f"e{i}" for i in range(engines)]

    async def main():
        d = CapacityDispatcher(capacity)
        d.set_engines(urls)
        running = {u: 0 for u in urls}
        done = 0

        async def request(i):
            nonlocal done
            url = await d.acquire(rng.choice([None, f"s{i % 5}"]))
            running[url] += 1
            assert running[url] <= capacity
            for _ in range(rng.randint(0, 3)):
                await asyncio.sleep(0)
            running[url] -= 1
            d.release(url)
            done += 1

        tasks = [asyncio.create_task(request(i)) for i in range(n)]
        while not all(t.done() for t in tasks):
            if d._waiters:  # the dispatcher's own count: a handed-out slot is taken before its task resumes
                assert all(d._engines[u].running == capacity for u in urls), running
            await asyncio.sleep(0)
        assert done == n
        assert d.take_stats()["rollout/cosched_requests"] == n

    run(main())

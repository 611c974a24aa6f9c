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
        with pytest.raises(ValueError, match="holds no such request"):
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


def test_a_session_on_a_listed_owner_that_left_the_router_moves():
    async def main():
        d = CapacityDispatcher(2)
        d.set_engines(["a", "b"])
        d.release(await d.acquire("s"))  # owner a (listed first)
        d.set_engines(["b"])
        assert await d.acquire("s") == "b"
        stats = d.take_stats()
        assert (stats["rollout/cosched_session_turns"], stats["rollout/cosched_owner_turns"],
                stats["rollout/cosched_moves"]) == (1, 0, 1)

    run(main())


def test_an_ended_session_is_placed_as_a_new_one():
    async def main():
        d = CapacityDispatcher(1)
        d.set_engines(["a", "b"])
        held = await d.acquire()  # a busy
        d.release(await d.acquire("s"))  # s owned by b
        assert d.owner("s") == "b"
        d.end_session("s")
        assert d.owner("s") is None
        d.release(held)
        assert await d.acquire("s") == "a"  # most free slots, no owner: not a move
        stats = d.take_stats()
        assert stats["rollout/cosched_moves"] == 0 and stats["rollout/cosched_session_turns"] == 0

    run(main())


def test_answers_are_counted_per_engine_with_owner_reuse_and_stale_prefixes():
    d = CapacityDispatcher(1)
    d.set_engines(["a", "b"])
    d.record_answer("a", 100, 60, owner_turn=True)
    d.record_answer("b", 50, 0)
    d.record_answer("b", 50, 40, stale_prefix=True)
    d.record_answer("a", 10, 5, stale_prefix=None)
    d.record_answer("gone", 7, 7)  # an engine the router no longer lists: counted overall only
    s = d.take_stats()
    assert (s["rollout/cosched_engine0_prompt_tokens"], s["rollout/cosched_engine0_cached_tokens"]) == (110, 65)
    assert (s["rollout/cosched_engine1_prompt_tokens"], s["rollout/cosched_engine1_cached_tokens"]) == (100, 40)
    assert s["rollout/cosched_answers"] == 5 and s["rollout/cosched_owner_cached_tokens"] == 60
    assert s["rollout/cosched_stale_prefix_answers"] == 1 and s["rollout/cosched_prefix_version_unreported"] == 1
    assert d.take_stats()["rollout/cosched_answers"] == 0  # a new window


# -- the placement policy against a reference model, over random interleavings of turns ------------------------
# An operation is ("start", session or None) or ("finish", k: the k-th running request, modulo their number).
# The reference: a free slot on the session's owner -> the owner; else the engine with the most free slots (first
# listed on ties), or the FIFO queue when every engine is full; a request that gets a slot from the queue is placed
# the same way at that moment. A later turn of a session is an owner turn or a move, never both.
_ops = st.lists(st.one_of(st.tuples(st.just("start"), st.sampled_from([None, "s0", "s1", "s2", "s3", "s4"])),
                          st.tuples(st.just("finish"), st.integers(0, 50))), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(engines=st.integers(1, 4), capacity=st.integers(1, 3), ops=_ops)
def test_placement_matches_the_reference_policy(engines, capacity, ops):
    urls = [f"e{i}" for i in range(engines)]

    async def main():
        d = CapacityDispatcher(capacity)
        d.set_engines(urls)
        running: list[tuple[str, asyncio.Task]] = []  # (url, task) in start order
        queue: list[tuple[str | None, asyncio.Task]] = []  # the reference's FIFO
        load = {u: 0 for u in urls}
        owners: dict[str, str] = {}
        want = {"turns": 0, "owner": 0, "moves": 0}

        def place(session):
            owner = owners.get(session)
            if owner is not None and load[owner] < capacity:
                url = owner
            else:
                free = [(capacity - load[u], -i, u) for i, u in enumerate(urls)]
                best = max(free)
                if best[0] <= 0:
                    return None
                url = best[2]
            if owner is not None:
                want["turns"] += 1
                want["owner" if url == owner else "moves"] += 1
            if session is not None:
                owners[session] = url
            load[url] += 1
            return url

        async def settle():
            for _ in range(3):
                await asyncio.sleep(0)

        for op, arg in ops:
            if op == "start":
                task = asyncio.create_task(d.acquire(arg))
                await settle()
                url = place(arg) if not queue else None
                if url is None:
                    queue.append((arg, task))
                    assert not task.done()
                else:
                    assert task.done() and task.result() == url, (arg, url, task)
                    running.append((url, task))
            elif running:
                url, _ = running.pop(arg % len(running))
                d.release(url)
                load[url] -= 1
                await settle()
                while queue:
                    session, task = queue[0]
                    url = place(session)
                    if url is None:
                        break
                    queue.pop(0)
                    assert task.done() and task.result() == url, (session, url)
                    running.append((url, task))
                assert all(not t.done() for _, t in queue)
        for u, n in load.items():
            assert d._engines[u].running == n
        stats = d.take_stats()
        assert (stats["rollout/cosched_session_turns"], stats["rollout/cosched_owner_turns"],
                stats["rollout/cosched_moves"]) == (want["turns"], want["owner"], want["moves"])
        assert stats["rollout/cosched_session_turns"] == stats["rollout/cosched_owner_turns"] + stats[
            "rollout/cosched_moves"]
        for _, task in queue:
            task.cancel()

    run(main())


@settings(max_examples=40, deadline=None)
@given(budgets=st.lists(st.integers(8, 64), min_size=1, max_size=3), costs=st.lists(st.integers(1, 80), min_size=1,
                                                                                    max_size=30),
       seed=st.integers(0, 10**6))
def test_kv_tokens_never_over_an_engines_budget_unless_alone_and_never_idle_while_a_request_fits(budgets, costs, seed):
    """The KV unit: each engine's budget its KV tokens, each request its prompt plus max_new_tokens. Whatever the
    order: an engine holds more than its budget only with one request (one above the whole budget runs alone), and
    the head of the queue waits only while it fits nowhere."""
    rng = random.Random(seed)
    urls = [f"e{i}" for i in range(len(budgets))]
    budget = dict(zip(urls, budgets))

    async def main():
        d = CapacityDispatcher(1, unit="kv_tokens")
        d.set_engines(urls, budgets=budget)
        held = {u: [] for u in urls}

        async def request(i, cost):
            url = await d.acquire(rng.choice([None, f"s{i % 4}"]), cost=cost)
            held[url].append(cost)
            assert sum(held[url]) <= budget[url] or len(held[url]) == 1, (url, held[url], budget[url])
            for _ in range(rng.randint(0, 3)):
                await asyncio.sleep(0)
            held[url].remove(cost)
            d.release(url, cost)

        tasks = [asyncio.create_task(request(i, c)) for i, c in enumerate(costs)]
        while not all(t.done() for t in tasks):
            if d._waiters:  # the head fits nowhere: every engine busy and too full for it
                head = d._waiters[0].cost
                assert all(e.running > 0 and e.budget - e.used < head for e in d._engines.values()), head
            await asyncio.sleep(0)
        stats = d.take_stats()
        assert stats["rollout/cosched_requests"] == len(costs)
        # above every budget: oversized wherever it ran; above the smallest only: oversized if it ran there alone
        assert sum(c > max(budgets) for c in costs) <= stats["rollout/cosched_oversized"] <= sum(
            c > min(budgets) for c in costs)
        assert all(e.used == 0 and e.running == 0 for e in d._engines.values())

    run(main())


def test_kv_tokens_place_by_free_tokens_and_keep_a_session_where_its_turn_fits():
    async def main():
        d = CapacityDispatcher(1, unit="kv_tokens")
        d.set_engines(["small", "big"], budgets={"small": 100, "big": 300})
        assert await d.acquire("s", cost=50) == "big"  # most free tokens
        assert await d.acquire(cost=200) == "big"  # 250 of 300 used
        assert await d.acquire("s", cost=80) == "small"  # the owner (big) has 50 free: moved
        assert d.owner("s") == "small"
        waiter = asyncio.create_task(d.acquire(cost=60))  # fits nowhere: small 20 free, big 50 free
        await asyncio.sleep(0)
        assert not waiter.done()
        d.release("big", 200)
        await asyncio.sleep(0)
        assert waiter.result() == "big"
        stats = d.take_stats()
        assert stats["rollout/cosched_engine0_budget"] == 100 and stats["rollout/cosched_engine1_budget"] == 300
        assert stats["rollout/cosched_moves"] == 1 and stats["rollout/cosched_oversized"] == 0
        with pytest.raises(ValueError, match="at least 1"):
            await d.acquire(cost=0)
        with pytest.raises(ValueError, match="budget of engine"):
            d.set_engines(["x"], budgets={"x": 0})

    run(main())

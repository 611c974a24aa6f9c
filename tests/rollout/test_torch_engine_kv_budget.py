"""The torch engine's KV budget (``serve-torch --max-total-tokens N``, SGLang's flag): running requests reserve their
prompt plus ``max_new_tokens``; the next request in arrival order waits until it fits (one above the whole budget
runs alone); ``/v1/loads`` reports the budget and the reservations in SGLang's fields."""

from __future__ import annotations

import threading
import time

import pytest

from slime_ascend.rollout.torch_engine.engine import TorchEngine


def _wait_until(engine, predicate, timeout_s: float = 60.0) -> None:
    """Poll ``predicate(engine)`` under the engine's state lock until it holds (no sleeps that a busy host outruns)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with engine._state:
            if predicate(engine):
                return
        time.sleep(0.005)
    raise AssertionError("the engine did not reach the state the test waits for")


def _generate_in_thread(engine, ids, new, out, name):
    def run():
        out[name] = (time.monotonic(), engine.generate({"input_ids": ids, "sampling_params": {
            "max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}}), time.monotonic())

    t = threading.Thread(target=run)
    t.start()
    return t


def test_requests_wait_for_kv_room_in_arrival_order_and_loads_report_it():
    engine = TorchEngine(max_total_tokens=100)
    assert engine.loads()["loads"][0]["max_total_num_tokens"] == 100
    assert engine.server_info()["max_total_num_tokens"] == 100
    snapshots = []
    engine_forward = engine._forward

    def watched(*a, **k):  # at each forward: the reservations and which requests run (by prompt length)
        with engine._state:
            snapshots.append((engine._kv_reserved, frozenset(len(r.input_ids) for r in engine._running.values())))
        return engine_forward(*a, **k)

    engine._forward = watched
    out = {}
    threads = [_generate_in_thread(engine, list(range(3, 13)), 80, out, "a")]  # 10 + 80 = 90 reserved
    _wait_until(engine, lambda e: e._running)  # each arrives after the one before (arrival order is the point)
    threads.append(_generate_in_thread(engine, list(range(3, 14)), 49, out, "b"))  # 11 + 49 = 60: waits for a
    _wait_until(engine, lambda e: any(len(r.input_ids) == 11 for r in e._live.values()))  # b has arrived
    threads.append(_generate_in_thread(engine, list(range(3, 8)), 5, out, "c"))  # 10 fits beside a; b is first
    for t in threads:
        t.join(120)
    assert [len(out[n][1]["output_ids"]) for n in "abc"] == [80, 49, 5]
    assert max(used for used, _ in snapshots) <= 100  # never more reserved than the budget
    assert {10, 11} not in [set(running) for _, running in snapshots]  # b never ran beside a: no room
    assert not any(running == {10, 5} for _, running in snapshots)  # c did not overtake b (arrival order)
    assert any(running == {11, 5} for _, running in snapshots)  # c ran once b had started, beside it
    assert engine.loads()["loads"][0]["num_used_tokens"] == 0


def test_a_request_above_the_whole_budget_runs_alone():
    engine = TorchEngine(max_total_tokens=20)
    answer = engine.generate({"input_ids": list(range(3, 13)), "sampling_params": {"max_new_tokens": 30,
                                                                                     "ignore_eos": True}})
    assert len(answer["output_ids"]) == 30


def test_the_budget_must_be_positive():
    with pytest.raises(ValueError, match="max_total_tokens"):
        TorchEngine(max_total_tokens=0)


def test_loads_report_reserved_and_waiting_tokens_without_a_budget_and_get_load_projects_them():
    """Without --max-total-tokens nothing waits for room, but /v1/loads still counts the running requests' reservations
    (num_used_tokens) and, with the waiting ones', num_total_tokens; /get_load is SGLang's projection of it."""
    engine = TorchEngine()
    seen = []
    engine_forward = engine._forward

    def watched(*a, **k):
        if not seen:
            seen.append((engine.loads()["loads"][0], engine.get_load()[0]))
        return engine_forward(*a, **k)

    engine._forward = watched
    engine.generate({"input_ids": list(range(3, 13)), "sampling_params": {"max_new_tokens": 7, "ignore_eos": True}})
    (load, legacy), = seen
    assert load["num_used_tokens"] == load["num_total_tokens"] == 17 and "max_total_num_tokens" not in load, load
    assert {k: v for k, v in legacy.items() if k != "ts_tic"} == {
        "dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 17, "num_pending_tokens": 0}, legacy
    assert engine.loads()["loads"][0]["num_used_tokens"] == 0 and engine.get_load()[0]["num_tokens"] == 0


def test_get_load_counts_a_waiting_request_as_pending():
    engine = TorchEngine(max_total_tokens=100)
    engine_forward = engine._forward
    seen = []

    def watched(*a, **k):  # a runs (90 reserved); its first forward waits until b waits for room (60 pending)
        if not seen:  # no timing: on a busy host a could finish before b came
            _wait_until(engine, lambda e: len(e._live) > len(e._running))
            seen.append(engine.get_load()[0])
        return engine_forward(*a, **k)

    engine._forward = watched
    out = {}
    threads = [_generate_in_thread(engine, list(range(3, 13)), 80, out, "a")]
    _wait_until(engine, lambda e: e._running)  # a holds its reservation before b arrives
    threads.append(_generate_in_thread(engine, list(range(3, 14)), 49, out, "b"))
    for t in threads:
        t.join(120)
    (legacy,) = seen
    assert legacy["num_reqs"] == 2 and legacy["num_waiting_reqs"] == 1, legacy
    assert legacy["num_tokens"] == 150 and legacy["num_pending_tokens"] == 60, legacy

"""benchmarks/bench_rollout_scheduling.py: runs end to end on two paced torch engines at a tiny size (no timing
asserts beyond the pacing itself: every request got exactly its length, a request's service time follows its
length at the fixed decode rate, both ways produced their rows); the modelled schedule on known inputs."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "benchmarks" / "bench_rollout_scheduling.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_rollout_scheduling", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_paced_engines_serve_both_ways(tmp_path):
    """One of the benchmark's engines (1 running, 20 ms a step; one engine: a process start is most of this test's
    time): a request's service time is (tokens - 1) steps (the first token is the prefill's), a second request
    waits for the slot instead of sharing it, and one small batch runs both ways, every request getting exactly
    its length, no makespan below the ideal."""
    bench = _bench()
    from slime_ascend.demo.slime_job import make_model, stop

    model = make_model(tmp_path / "tiny")
    engines = [bench._start_paced(model, tmp_path / "engine.log", 1, 0.02)]
    try:
        async def pair():
            import httpx

            async with httpx.AsyncClient() as client:
                await bench._generate(client, engines[0].url, 2)  # warm-up
                return await asyncio.gather(bench._generate(client, engines[0].url, 30),
                                            bench._generate(client, engines[0].url, 5))

        long, short = asyncio.run(pair())
        lengths = [4, 24, 4, 4]
        ways = {way: asyncio.run(bench._one_way([e.url for e in engines], lengths, way, 2, 1))
                for way in ("default", "cosched")}
    finally:
        for engine in engines:
            stop(engine.proc)
    assert long["paced_steps"] == 29 and short["paced_steps"] == 4
    # 20 ms a step (the pace's clock starts 1 ms or less before the engine's e2e_latency does). A step that overran
    # (a forward, or a sleep that woke late, past its due time: counted by the engine) only adds time, by as much as
    # the host was busy: the upper bound holds for a request none of whose steps overran (a CI host running two slime
    # jobs beside this test once took 1.25 s for the 29 steps)
    for answer, steps in ((long, 29), (short, 4)):
        assert steps * 0.02 - 1e-3 <= answer["e2e_latency"], answer
        if answer["paced_overran"] == 0:
            assert answer["e2e_latency"] < steps * 0.02 * 1.5 + 0.2, answer
    for way, r in ways.items():
        assert r["steps"] == sum(n - 1 for n in lengths), (way, r)
        assert r["makespan"] >= r["ideal"] >= 23 * 0.02 and r["modelled"] >= r["ideal"] - 1e-9, (way, r)
    rows = {row["name"]: row for row in bench.summarise({w: [r] for w, r in ways.items()}, "test")}
    assert set(rows) == {"rollout_scheduling/default", "rollout_scheduling/cosched",
                         "rollout_scheduling/default_over_cosched"}


def test_the_modelled_schedule_of_both_ways():
    modelled = _bench()._modelled
    # 2 engines running 1 each, 1 in flight per engine, a long request first: round robin sends the third to the
    # long one's engine, where it waits
    service = [10.0, 1.0, 1.0, 1.0]
    assert modelled(service, 2, 1, 1, "default") == 11.0  # 0 -> e0, 1 -> e1, 2 -> e0 behind 0, 3 -> e1
    assert modelled(service, 2, 1, 1, "cosched") == 10.0  # 1, 2, 3 one after the other on e1 while e0 runs 0
    # 2 in flight per engine: one request waits at each engine
    service = [10.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert modelled(service, 2, 1, 2, "default") == 12.0  # 2 and 4 wait behind 0 on e0
    assert modelled(service, 2, 1, 2, "cosched") == 11.0  # only 2 (placed while both engines had a slot) does
    assert modelled([1.0] * 8, 2, 2, 2, "default") == modelled([1.0] * 8, 2, 2, 2, "cosched") == 2.0


def test_the_batch_has_its_tail_and_seeds_move_it():
    lengths = _bench()._lengths
    a, b = lengths(32, 8, 3, 20, 0), lengths(32, 8, 3, 20, 1)
    assert sorted(a) == sorted(b) == [8] * 29 + [160] * 3 and a != b


def test_the_summary_passes_only_where_the_default_is_off_and_the_rate_held():
    summarise = _bench().summarise

    def result(makespan, steps=100, overran=0):
        return {"makespan": makespan, "ideal": 1.0, "modelled": makespan, "steps": steps, "overran": overran}

    rows = {r["name"].split("/")[1]: r for r in summarise({"default": [result(1.4)], "cosched": [result(1.05)]}, "")}
    assert rows["cosched"]["passed"] is True and rows["default_over_cosched"]["ratio"] == pytest.approx(1.4 / 1.05)
    rows = {r["name"].split("/")[1]: r for r in summarise({"default": [result(1.4)], "cosched": [result(1.2)]}, "")}
    assert rows["cosched"]["passed"] is False
    slow = summarise({"default": [result(1.4)], "cosched": [result(1.05, overran=10)]}, "")
    assert slow[1]["passed"] is False and "RATE NOT HELD" in slow[1]["detail"]
    close = summarise({"default": [result(1.05)], "cosched": [result(1.02)]}, "")
    assert close[1]["passed"] is None and "not applicable" in close[1]["detail"]


def test_main_prints_wall_and_modelled_ratios_side_by_side(monkeypatch, capsys):
    bench = _bench()
    rows = [{"name": "rollout_scheduling/default", "ratio": 1.45, "modelled": 1.44, "target": None, "passed": None,
             "detail": "d"},
            {"name": "rollout_scheduling/cosched", "ratio": 1.04, "modelled": 1.03, "target": 1.1, "passed": True,
             "detail": "c"},
            {"name": "rollout_scheduling/default_over_cosched", "ratio": 1.39, "modelled": None, "target": None,
             "passed": None, "detail": "r"}]
    monkeypatch.setattr(bench, "run", lambda *a, **k: rows)
    monkeypatch.setattr(sys, "argv", ["bench"])
    bench.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("host: ")
    printed = {line.split()[0]: line.split() for line in out if line.startswith("rollout_scheduling/")}
    assert printed["rollout_scheduling/default"][1:3] == ["1.450", "1.440"]
    assert printed["rollout_scheduling/cosched"][1:6] == ["1.040", "1.030", "<=", "1.1", "PASS"]


def test_bench_refuses_a_bad_layout_in_one_line():
    r = subprocess.run([sys.executable, str(BENCH), "--engines", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--engines must be 1..8" in r.stderr and "Traceback" not in r.stderr


def test_kv_rows_model_both_units_on_the_real_dispatcher():
    """The KV-capacity rows: on known inputs the modelled schedule respects the area bound, and counting KV tokens
    beats counting requests when the engines' KV budgets differ (a deterministic model, no timing)."""
    bench = _bench()
    rows = {r["name"]: r for r in bench.kv_row(quick=True, seeds=2)}
    requests, kv = rows["rollout_scheduling_kv/requests"], rows["rollout_scheduling_kv/kv_tokens"]
    assert 1.0 <= kv["ratio"] < requests["ratio"], (kv, requests)
    # the oracle order respects the bound too, and the online dispatch is compared with it
    offline, over = rows["rollout_scheduling_kv/offline_longest_first"], rows["rollout_scheduling_kv/kv_tokens_over_offline"]
    assert 1.0 <= offline["ratio"] and over["target"] == 1.1 and over["passed"] == (over["ratio"] <= 1.1)
    assert over["ratio"] == pytest.approx(kv["ratio"] / offline["ratio"], rel=0.05)  # medians of per-seed ratios
    # one request alone: its duration, whatever the unit; two that do not fit together on one engine run one after
    # the other there, side by side on two
    assert bench.kv_schedule([100], [150], [2.0], "kv_tokens", 1) == 2.0
    assert bench.kv_schedule([100], [60, 60], [1.0, 1.0], "kv_tokens", 4) == 2.0
    assert bench.kv_schedule([100], [60, 60], [1.0, 1.0], "requests", 4) == 2.0  # the engine queues the second
    assert bench.kv_schedule([100, 100], [60, 60], [1.0, 1.0], "kv_tokens", 4) == 1.0

"""Teacher-grouped scoring (``opd/switching.py``): per rollout at most one switch per teacher it needs, the
resident teacher first, every sample scored by its routed teacher exactly once, whatever the completion order."""

from __future__ import annotations

import asyncio
import random
import types
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slime_ascend.compat.sample import get_sample_class
from slime_ascend.opd import hooks, scoring
from slime_ascend.opd.plugin import PLUGIN
from slime_ascend.opd.switching import SwitchGate, grouped_order, score_grouped

Sample = get_sample_class()
NAMES = ["A", "B", "C"]


class FakeEngine:
    """One engine holding one teacher: a switch is refused while a request is in flight."""

    def __init__(self) -> None:
        self.resident: str | None = None
        self.busy = 0
        self.switch_log: list[str] = []
        self.prefetched: list[str] = []

    async def switch(self, name: str) -> None:
        assert self.busy == 0, "switched while requests were in flight"
        await asyncio.sleep(0)
        self.resident = name
        self.switch_log.append(name)

    async def prefetch(self, name: str) -> None:
        self.prefetched.append(name)


def test_grouped_order_puts_the_resident_then_the_prefetched_teacher_first():
    assert grouped_order("BCABC", None) == ["B", "C", "A"]
    assert grouped_order("BCABC", "A") == ["A", "B", "C"]
    assert grouped_order("BCABC", "A", prefer="C") == ["A", "C", "B"]
    assert grouped_order("BCB", "A", prefer="A") == ["B", "C"]  # neither needed: order of appearance


def _rollouts():
    teacher = st.sampled_from(NAMES)
    return st.lists(st.lists(teacher, min_size=0, max_size=12), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(rollouts=_rollouts(), seed=st.integers(0, 2**16))
def test_grouped_scoring_switches_at_most_once_per_needed_teacher(rollouts, seed):
    """Random rollouts whose samples arrive in random order: per rollout the switches are at most the distinct
    teachers needed (one less when the resident one is needed), each job runs once with its teacher resident,
    and results come back in the jobs' order."""
    rng = random.Random(seed)

    async def main():
        engine = FakeEngine()
        gate = SwitchGate(engine.switch)
        for routes in rollouts:
            arrival = list(enumerate(routes))
            rng.shuffle(arrival)
            ran: Counter = Counter()

            def job(i, name):
                async def request():
                    engine.busy += 1
                    assert engine.resident == name
                    await asyncio.sleep(rng.random() * 0.001)
                    assert engine.resident == name
                    engine.busy -= 1
                    ran[i] += 1
                    return (i, name)
                return request

            before, resident = len(engine.switch_log), engine.resident
            results = await score_grouped(gate, [(n, job(i, n)) for i, n in arrival], prefetch=engine.prefetch)
            assert results == arrival
            assert ran == Counter({i: 1 for i in range(len(routes))})
            switched = engine.switch_log[before:]
            needed = set(routes)
            assert len(switched) <= len(needed) - (resident in needed)
            assert len(set(switched)) == len(switched)  # no teacher twice in a rollout
            if routes and resident in needed:
                assert resident not in switched  # the carried-over teacher is served first
            assert engine.resident == (switched[-1] if switched else resident)
        assert gate.switches == len(engine.switch_log) and gate.inflight == 0

    asyncio.run(main())


def test_a_failed_switch_fails_only_that_teachers_jobs():
    async def main():
        async def switch(name):
            if name == "bad":
                raise RuntimeError("teacher 'bad': checkpoint missing")

        async def ok():
            return "ok"

        return await score_grouped(SwitchGate(switch), [("A", ok), ("bad", ok), ("A", ok), ("C", ok)])

    results = asyncio.run(main())
    assert results[0] == results[2] == results[3] == "ok"
    assert isinstance(results[1], RuntimeError) and "checkpoint missing" in str(results[1])


# ------------------------------------------------------------------------------ through the opd hooks
class FakeSwitcher:
    """The pool behind the gate: records switches and prefetches, holds the resident teacher."""

    def __init__(self) -> None:
        self.resident: str | None = None
        self.switches: list[str] = []
        self.prefetched: list[str] = []

    async def activate(self, name: str) -> None:
        self.resident = name
        self.switches.append(name)

    async def prefetch(self, name: str) -> None:
        self.prefetch_now(name)

    def prefetch_now(self, name: str) -> None:
        self.prefetched.append(name)

    def metrics(self) -> dict:
        return {"switches": len(self.switches)}


def _args():
    values = {s.key: s.default for s in PLUGIN.settings}
    values.update(dict(PLUGIN.slime_args))
    teachers = [{"name": n, "checkpoint_dir": f"/nonexistent/{n}", "domains": [n.lower()]} for n in NAMES]
    teachers.append({"name": "U", "checkpoint_dir": "/nonexistent/U", "domains": ["u"], "url": "http://url-teacher"})
    values.update(ascend_plugins=["opd"], ascend_opd_teachers=teachers, opd_teacher_load=None,
                  rollout_temperature=1.0, use_rollout_logprobs=False, hf_checkpoint=None,
                  ascend_opd_switch_engine_urls=["http://switched"], ascend_opd_same_origin_check=False)
    return types.SimpleNamespace(**values)


def _teacher_lp(name: str, token: int) -> float:
    return -0.01 * (NAMES + ["U"]).index(name) - 0.001 * (token % 7)


@pytest.mark.usefixtures("opd_state")
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rollouts=st.lists(st.lists(st.sampled_from(NAMES + ["U"]), min_size=1, max_size=10), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_hooks_score_each_rollout_grouped_whatever_the_completion_order(rollouts, seed):
    """slime's per-sample ``reward_model`` calls in a random completion order, then the rollout's
    ``reward_post_process``: each sample gets exactly its routed teacher's log-probs (from one request, with
    that teacher resident on the switched engine), and the switched engine switches at most once per
    switched teacher the rollout needs."""
    hooks.reset_state()  # each example starts from a fresh plugin state (the fixture resets around the test)
    rng = random.Random(seed)
    args = _args()
    ctx = hooks.get_context(args)
    switcher = ctx.switcher = FakeSwitcher()
    posts: Counter = Counter()

    async def fake_post(url, payload, timeout_s, retries, ctx_):
        tokens = payload["input_ids"]
        teacher = "U" if url.startswith("http://url-teacher") else switcher.resident
        posts[(tuple(tokens), teacher)] += 1
        await asyncio.sleep(rng.random() * 0.001)
        return {"meta_info": {"input_token_logprobs": [[None]] + [[_teacher_lp(teacher, t)] for t in tokens[1:]]}}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scoring, "_post_json", fake_post)
        index = _run_rollouts(args, rollouts, switcher, rng, posts)
    assert sum(posts.values()) == index
    assert hooks.opd_stats(args)["switches"] == len(switcher.switches)


def _run_rollouts(args, rollouts, switcher, rng, posts) -> int:
    index = 0
    for routes in rollouts:
        samples = []
        for name in routes:
            s = Sample(index=index, tokens=[index * 10 + k for k in range(5)], response_length=3)
            s.metadata = {"domain": name.lower()}
            samples.append(s)
            index += 1

        async def complete(batch):
            async def one(s):
                await asyncio.sleep(rng.random() * 0.002)  # generation finishes in random order
                return await hooks.teacher_reward(args, s)
            return await asyncio.gather(*(one(s) for s in batch))

        asyncio.run(complete(samples))
        # the url teacher scored as each sample completed; the switched ones wait for the rollout
        assert all(("opd_teacher_log_probs" in s.metadata) == (n == "U") for s, n in zip(samples, routes, strict=True))
        pending = {s.index for s in samples if "opd_pending_teacher" in s.metadata}
        assert pending == {s.index for s, n in zip(samples, routes, strict=True) if n != "U"}
        resident, before = switcher.resident, len(switcher.switches)
        hooks.fill_teacher_log_probs(args, samples, [0.0] * len(samples), [0.0] * len(samples))
        for s, name in zip(samples, routes, strict=True):
            assert s.metadata["opd_teacher"] == name and "opd_pending_teacher" not in s.metadata
            assert s.teacher_log_probs.tolist() == pytest.approx([_teacher_lp(name, t) for t in s.tokens[-3:]])
            assert posts[(tuple(s.tokens), name)] == 1
        needed = set(routes) - {"U"}
        switched = switcher.switches[before:]
        assert len(switched) <= len(needed) - (resident in needed) and len(set(switched)) == len(switched)
    return index

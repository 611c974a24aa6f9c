"""reward-mix under bad input and faulty graders: what would fail every sample later is refused at start in one
line; a grader that hangs, blocks or exits fails its own sample only."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import types
from types import SimpleNamespace

import pytest

from slime_ascend.plugins import runtime
from slime_ascend.plugins.settings import SettingsError
from slime_ascend.reward_mix import hooks
from slime_ascend.reward_mix.mix import combine, parse_terms


@pytest.fixture
def graders(monkeypatch):
    release = threading.Event()

    def good(args, sample, **_):
        return 1.0

    def exits(args, sample, **_):
        sys.exit(3)

    async def hangs(args, sample, **_):
        await asyncio.sleep(3600)

    def blocks(args, sample, **_):  # a synchronous judge waiting on the network
        release.wait(5)
        return 0.5

    def needs_rubric(args, sample, *, rubric):
        return 1.0

    module = types.SimpleNamespace(good=good, exits=exits, hangs=hangs, blocks=blocks, needs_rubric=needs_rubric,
                                   not_a_function=3)
    monkeypatch.setitem(sys.modules, "rm_graders", module)
    hooks.reset()
    runtime.reset()
    yield release
    release.set()
    hooks.reset()
    runtime.reset()


def _args(components, penalties=(), **extra):
    return SimpleNamespace(ascend_plugins=["reward-mix"], ascend_reward_components=list(components),
                           ascend_reward_penalties=list(penalties), rm_type=None, custom_rm_path=None, **extra)


def _sample():
    return SimpleNamespace(index=0, metadata={}, train_metadata=None, weight_versions=[], response="x", label="x")


@pytest.mark.parametrize(("components", "needle"), [
    ([{"name": "j", "path": "rm_graders.gone"}], "path 'rm_graders.gone' does not resolve (AttributeError"),
    ([{"name": "j", "path": "no_such_pkg.judge"}], "does not resolve (ModuleNotFoundError"),
    ([{"name": "j", "path": "rm_graders.not_a_function"}], "is a int, not a function"),
    ([{"name": "j", "path": "rm_graders.needs_rubric"}], "cannot be called as fn(args, sample)"),
    ([{"name": "j", "path": "rm_graders.needs_rubric", "kwargs": {"rubrik": "r"}}], "fn(args, sample, rubrik=...)"),
    ([{"name": "a", "path": "rm_graders.good", "weight": 0}, {"name": "b", "path": "rm_graders.good", "weight": 0.0}],
     "every weight of ascend_reward_components is 0"),
    ([], "ascend_reward_components is empty"),
])
def test_what_would_fail_every_sample_is_refused_at_start(graders, components, needle):
    with pytest.raises(SettingsError) as info:  # a SettingsError: parse_args prints it as one line, exit 2
        runtime.check(_args(components))
    assert needle in str(info.value) and "\n" not in str(info.value) and "Fix:" in str(info.value)


def test_the_right_kwargs_are_accepted(graders):
    runtime.check(_args([{"name": "j", "path": "rm_graders.needs_rubric", "kwargs": {"rubric": "r"}}]))


@pytest.mark.slime
def test_an_unknown_rule_is_refused_against_this_slimes_rules(graders):
    with pytest.raises(SettingsError, match=r"rm_type 'maths' is not a rule of this slime's async_rm \(it has .*math"):
        runtime.check(_args([{"name": "r", "rm_type": "maths"}]))
    runtime.check(_args([{"name": "r", "rm_type": "boxed_math"}, {"name": "f", "rm_type": "f1"}]))


def _score(components, **extra):
    args = _args(components, **extra)
    sample = _sample()
    start = time.monotonic()
    reward = asyncio.run(hooks.reward(args, sample))
    return reward, sample.metadata["reward_mix"], time.monotonic() - start


def test_a_grader_calling_sys_exit_fails_its_sample_not_the_rollout(graders):
    reward, record, _ = _score([{"name": "good", "path": "rm_graders.good"}, {"name": "bad", "path": "rm_graders.exits"}])
    assert reward == 0.0 and record["failure"] == "bad: SystemExit: 3"
    assert record["components"] == {"good": 1.0, "bad": None}


def test_a_grader_that_never_answers_fails_its_sample_at_the_time_limit(graders):
    reward, record, seconds = _score([{"name": "good", "path": "rm_graders.good"},
                                      {"name": "slow", "path": "rm_graders.hangs"}],
                                     ascend_reward_term_timeout_s=0.5)
    assert record["failure"].startswith("slow: TimeoutError: no answer within 0.5 s (ascend_reward_term_timeout_s)")
    assert seconds < 5


def test_a_synchronous_judge_runs_off_the_event_loop(graders):
    """Two samples scored concurrently by a blocking judge: with the judge on the event loop they would take
    twice its wait; off the loop (a worker thread) the loop stays free while it blocks."""
    release = graders
    args = _args([{"name": "j", "path": "rm_graders.blocks"}])

    async def both():
        ticks = []

        async def ticker():
            for _ in range(5):
                ticks.append(time.monotonic())
                await asyncio.sleep(0.05)
            release.set()

        got = await asyncio.gather(hooks.reward(args, _sample()), hooks.reward(args, _sample()), ticker())
        return got, ticks

    (r1, r2, _), ticks = asyncio.run(both())
    assert r1 == r2 == 0.5
    assert len(ticks) == 5 and ticks[-1] - ticks[0] < 2  # the loop kept running while both judges blocked


def test_an_overflowing_weighted_sum_fails_the_sample():
    comps = parse_terms([{"name": "a", "path": "m.a", "weight": 1e308}, {"name": "b", "path": "m.b", "weight": 1e308}],
                        "ascend_reward_components")
    total, failure = combine(comps, (), {"a": 1.0, "b": 1.0})
    assert total is None and failure == "the weighted sum overflows (inf)"

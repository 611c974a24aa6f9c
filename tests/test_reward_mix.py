"""reward-mix: the declared mix (pure), the reward model and failure rule on slime's own Sample."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest

from slime_ascend.reward_mix import hooks, terms
from slime_ascend.reward_mix.mix import MixError, Term, combine, parse_terms

COMPONENTS = [{"name": "correct", "rm_type": "math", "weight": 1.0},
              {"name": "judge", "path": "tests_reward_terms.judge", "weight": 0.5, "kind": "judge"}]
PENALTIES = [{"name": "length", "path": "slime_ascend.reward_mix.terms.response_length", "lambda": 0.2,
              "kwargs": {"budget": 2}}]


def test_parse_terms_defaults_and_one_line_errors():
    comps = parse_terms(COMPONENTS, "ascend_reward_components")
    assert [(t.name, t.coef, t.kind) for t in comps] == [("correct", 1.0, "rule"), ("judge", 0.5, "judge")]
    (pen,) = parse_terms(PENALTIES, "ascend_reward_penalties", penalty=True)
    assert (pen.coef, pen.kind, pen.kwargs) == (0.2, "penalty", (("budget", 2),))
    bad = [
        ([{"name": "x"}], "exactly one of path"),
        ([{"name": "x", "path": "a.b", "rm_type": "math"}], "exactly one of path"),
        ([{"name": "x", "path": "nodot"}], "dotted function path"),
        ([{"name": "x y", "rm_type": "math"}], "must be a word"),
        ([{"name": "x", "rm_type": "math", "weight": float("nan")}], "finite number"),
        ([{"name": "x", "rm_type": "math", "kind": "oracle"}], "kind must be one of"),
        ([{"name": "x", "rm_type": "math", "colour": 1}], "unknown keys"),
        ([{"name": "x", "rm_type": "math"}, {"name": "x", "rm_type": "f1"}], "names a term twice"),
        ("math", "must be a list"),
    ]
    for value, message in bad:
        with pytest.raises(MixError, match=message) as err:
            parse_terms(value, "ascend_reward_components")
        assert "\n" not in str(err.value) and "ascend_reward_components" in str(err.value)
    with pytest.raises(MixError, match=">= 0"):
        parse_terms([{"name": "p", "rm_type": "math", "lambda": -1}], "ascend_reward_penalties", penalty=True)


def test_combine_is_the_weighted_sum_minus_penalties_and_fails_rather_than_scoring_low():
    comps = (Term("a", 1.0, "rule"), Term("b", 0.5, "judge"))
    pens = (Term("p", 0.2, "penalty"),)
    assert combine(comps, pens, {"a": 1, "b": {"score": 0.8}, "p": 0.5}) == (pytest.approx(1.3), None)
    assert combine(comps, pens, {"a": True, "b": 0.0, "p": 0.0}) == (1.0, None)
    for broken in (RuntimeError("judge timed out"), float("nan"), None, "high", math.inf):
        total, reason = combine(comps, pens, {"a": 1, "b": broken, "p": 0})
        assert total is None and reason.startswith("b: "), reason


def test_terms():
    args = SimpleNamespace(rollout_max_response_len=8)
    assert terms.response_length(args, SimpleNamespace(response_length=6), budget=2) == 0.5
    assert terms.response_length(args, SimpleNamespace(response_length=1), budget=2) == 0.0


@pytest.mark.slime
def test_reward_model_and_failure_rule_on_slimes_samples(monkeypatch, caplog):
    from slime.utils.types import Sample

    from slime_ascend.plugins import runtime

    judged = {}

    def judge(args, sample, **_):
        if sample.index == 1:
            raise TimeoutError("judge did not answer in 30 s")
        judged[sample.index] = True
        return 0.8

    import sys
    import types

    monkeypatch.setitem(sys.modules, "tests_reward_terms", types.SimpleNamespace(judge=judge))
    hooks.reset()
    runtime.reset()
    args = SimpleNamespace(ascend_plugins=["reward-mix"], ascend_reward_components=COMPONENTS,
                           ascend_reward_penalties=PENALTIES, rm_type="deepscaler", custom_rm_path="x.y",
                           rollout_max_response_len=8)
    samples = [Sample(index=i, group_index=0, prompt="1+1?", response="\\boxed{2}" if i != 2 else "3", label="2",
                      response_length=2 + 2 * i, weight_versions=["3"]) for i in range(3)]
    rewards = [asyncio.run(hooks.reward(args, s)) for s in samples]
    r0 = samples[0].metadata["reward_mix"]
    assert r0["components"] == {"correct": 1, "judge": 0.8} and r0["penalties"] == {"length": 0.0}
    assert rewards[0] == pytest.approx(1.4) and r0["failure"] is None and r0["weight_versions"] == ["3"]
    assert samples[0].train_metadata["reward_mix"] is r0  # travels to training
    assert rewards[2] == pytest.approx(0 + 0.4 - 0.2 * 0.5)  # wrong answer, longer response
    assert samples[1].metadata["reward_mix"]["failure"].startswith("judge: TimeoutError")
    with caplog.at_level("INFO", logger="slime_ascend.reward_mix"):
        raw, out = hooks.fail_unscored(args, samples, list(rewards), list(rewards))
    # the failed sample trains nothing; its (logged) raw reward is its group's scored mean, a placeholder
    assert samples[1].remove_sample and samples[1].status == Sample.Status.FAILED
    assert raw[1] == out[1] == pytest.approx((rewards[0] + rewards[2]) / 2)
    assert not samples[0].remove_sample and raw[0] == rewards[0]
    report = hooks.metrics(args, samples, 1)
    assert report["rollout/reward_mix_correct"] == 0.5 and report["rollout/reward_mix_judge"] == pytest.approx(0.8)
    assert report["rollout/reward_mix_penalty_length"] == pytest.approx(0.25)
    assert report["rollout/reward_mix_failed"] == 1 and report["rollout/reward_mix_scored"] == 2
    assert "reward_mix -: {" in caplog.text


# ---- a failed member and its group's baseline (slime_ascend.hooks.reward_post_process) -------------------
# group 0: judge rewards [1, 0, 1, fail, 0, 1]; group 1: [1, 0], nothing failed; group 2: [1, fail, fail]
JUDGED = {0: [1, 0, 1, None, 0, 1], 1: [1, 0], 2: [1, None, None]}


def _judge_from_table(args, sample, **_):
    value = JUDGED[sample.group_index][sample.index - 10 * sample.group_index]
    if value is None:
        raise TimeoutError("judge did not answer")
    return value


def _unbiased(values):  # hand-written: mean and sample (n - 1) standard deviation, as torch.std
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


@pytest.mark.parametrize("estimator,normalise,divide", [
    ("grpo", True, True), ("gspo", True, True), ("cispo", True, True), ("grpo", False, False),
    ("reinforce_plus_plus_baseline", False, False), ("grpo", None, False), ("ppo", None, False)])
def test_failed_member_takes_no_part_in_its_groups_mean_or_std(monkeypatch, fresh_runtime, estimator, normalise,
                                                               divide):
    """``normalise``: --grpo-std-normalization on / off, None: --disable-rewards-normalization (or an
    estimator slime does not group)."""
    import sys
    import types

    from slime_ascend import hooks as dispatch
    from slime_ascend.compat.sample import FallbackSample as Sample

    monkeypatch.setitem(sys.modules, "tests_reward_terms", types.SimpleNamespace(judge=_judge_from_table))
    hooks.reset()
    args = SimpleNamespace(ascend_plugins=["reward-mix"], ascend_reward_penalties=[],
                           ascend_reward_components=[{"name": "judge", "path": "tests_reward_terms.judge"}],
                           advantage_estimator=estimator, rewards_normalization=normalise is not None,
                           grpo_std_normalization=bool(normalise), reward_key=None)
    samples = [Sample(index=10 * g + j, group_index=g) for g, row in JUDGED.items() for j in range(len(row))]
    for s in samples:
        s.reward = asyncio.run(hooks.reward(args, s))
    raw, out = dispatch.reward_post_process(args, samples)

    failed = [s.index for s in samples if s.remove_sample]
    assert failed == [3, 21, 22] and all(samples[i].status == Sample.Status.FAILED for i in (3, 9, 10))
    mean0, std0 = _unbiased([1, 0, 1, 0, 1])  # the five scored members only: 0.6, sqrt(1.2 / 4)
    mean1, std1 = _unbiased([1, 0])
    if normalise is None:  # raw rewards; a failed member's is 0
        expected = [1, 0, 1, 0, 0, 1] + [1, 0] + [1, 0, 0]
    else:
        expected = [(v - mean0) / (std0 + 1e-6 if divide else 1) for v in (1, 0, 1)] + [0.0] + [
            (v - mean0) / (std0 + 1e-6 if divide else 1) for v in (0, 1)] + [
            (v - mean1) / (std1 + 1e-6 if divide else 1) for v in (1, 0)] + [0.0, 0.0, 0.0]  # one scored: no baseline
    assert out == pytest.approx(expected, abs=1e-5)
    assert not any(math.isnan(v) for v in out)
    if divide:  # the reviewer's numbers: [0.8165, -1.2247, ...] with the failed member counted in the std
        assert [round(out[i], 4) for i in (0, 1, 2, 4, 5)] == [0.7303, -1.0954, 0.7303, -1.0954, 0.7303]
    # logged raw rewards: a failed member shows its group's scored mean (the batch mean is the scored one's)
    assert raw[3] == pytest.approx(0.6) and raw[9] == raw[10] == 1.0

"""staleness (:mod:`slime_ascend.offpolicy.staleness`) with slime-shaped samples (no slime needed)."""

from __future__ import annotations

import math
import types

import pytest
from plugin_args import plugin_args

from slime_ascend import hooks
from slime_ascend.compat.sample import get_sample_class
from slime_ascend.offpolicy import staleness as staleness_hook
from slime_ascend.offpolicy.plugin import STALENESS
from slime_ascend.plugins import runtime

Sample = get_sample_class()
PLUGINS = {"staleness": STALENESS}


@pytest.fixture(autouse=True)
def _clean(fresh_runtime, monkeypatch):
    monkeypatch.delenv("SLIME_ASCEND_PLUGINS", raising=False)
    staleness_hook.reset_state()
    yield
    staleness_hook.reset_state()


def make_args(plugins, **overrides):
    return plugin_args([PLUGINS[name] for name in plugins], **overrides)


# ---------------------------------------------------------------------------------------------- staleness
def sample(index, group, versions, status="COMPLETED", reward=0.0, rollout_id=None):
    s = Sample(index=index, group_index=group, tokens=[1, 2, 3, 4], response_length=2, reward=reward,
               rollout_id=rollout_id)
    s.weight_versions = [str(v) for v in versions]
    s.status = Sample.Status[status]
    return s


def test_staleness_drops_lag_above_tau_without_group_rule():
    args = make_args(["staleness"], ascend_staleness_tau=2, ascend_staleness_group_rule=False)
    samples = [sample(0, 0, [5]), sample(1, 0, [3, 5]), sample(2, 1, [2, 4]), sample(3, 1, [7])]
    raw, rew = [1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]
    out_raw, out_rew = staleness_hook.staleness_post_process(args, samples, raw, rew)
    assert out_raw == raw and out_rew == rew
    # trainer version = newest seen = 7; lags 2, 4, 5, 0
    assert [s.remove_sample for s in samples] == [False, True, True, False]
    assert [s.metadata["ascend_staleness"]["lag"] for s in samples] == [2, 4, 5, 0]
    report = staleness_hook.last_staleness_report()
    assert report["trainer_version"] == 7 and report["stale"] == report["dropped"] == 2 and report["kept"] == 2
    assert report["lag_histogram"] == {0: 1, 2: 1, 4: 1, 5: 1}


def test_staleness_counts_reach_slimes_rollout_metrics(monkeypatch, caplog):
    """Each call reports rollout/staleness_* as one ``staleness <rollout_id>: {...}`` line (the shape of slime's
    own rollout metric line) and, with a tracker on, through slime's logging_utils.log at the rollout step."""
    import ast
    import sys

    logged = []
    fake_hooks = types.SimpleNamespace(_current_rollout_id=3)
    fake_logging = types.SimpleNamespace(log=lambda a, metrics, step_key: logged.append((metrics, step_key)))
    fake_metric_utils = types.SimpleNamespace(compute_rollout_step=lambda a, rid: rid * 10)
    monkeypatch.setitem(sys.modules, "slime.rollout.sample_hooks", fake_hooks)
    monkeypatch.setitem(sys.modules, "slime.observability.logging_utils", fake_logging)
    monkeypatch.setitem(sys.modules, "slime.observability.metric_utils", fake_metric_utils)
    monkeypatch.setitem(sys.modules, "slime.observability", types.SimpleNamespace(logging_utils=fake_logging,
                                                                                  metric_utils=fake_metric_utils))
    args = make_args(["staleness"], ascend_staleness_tau=0, ascend_staleness_group_rule=False, use_tensorboard=True)
    samples = [sample(0, 0, [5]), sample(1, 0, [4]), sample(2, 1, [5])]
    with caplog.at_level("INFO", logger="slime_ascend.staleness"):
        staleness_hook.staleness_post_process(args, samples, [0.0] * 3, [0.0] * 3)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("staleness 3: {"))
    metrics = ast.literal_eval(line.split(": ", 1)[1])
    assert metrics["rollout/staleness_dropped"] == metrics["rollout/staleness_stale"] == 1.0
    assert metrics["rollout/staleness_kept"] == 2.0 and metrics["rollout/staleness_max_lag"] == 1.0
    assert metrics["rollout/staleness_trainer_version"] == 5.0
    assert logged == [({**metrics, "rollout/step": 30}, "rollout/step")]
    # no tracker: the log line only
    logged.clear()
    staleness_hook.staleness_post_process(make_args(["staleness"]), [sample(3, 0, [5])], [0.0], [0.0])
    assert logged == []


def test_staleness_trainer_version_is_a_high_water_mark():
    args = make_args(["staleness"], ascend_staleness_tau=1, ascend_staleness_group_rule=False)
    staleness_hook.staleness_post_process(args, [sample(0, 0, [9])], [0.0], [0.0])
    later = [sample(1, 0, [7]), sample(2, 0, ["000008"])]
    staleness_hook.staleness_post_process(args, later, [0.0, 0.0], [0.0, 0.0])
    assert [s.remove_sample for s in later] == [True, False]


def test_group_rule_pads_and_drops_and_baseline_uses_valid_rollouts_only(fresh_runtime):
    args = make_args(["staleness"], ascend_staleness_tau=2)
    samples = [
        # group 0: one failed, one stale, two valid -> 2 of 4 valid: kept, two padded
        sample(0, 0, [10], reward=1.0), sample(1, 0, [], status="FAILED", reward=0.0),
        sample(2, 0, [6], reward=0.3), sample(3, 0, [9], reward=0.0),
        # group 1: three stale -> 1 of 4 valid: dropped whole
        sample(4, 1, [1], reward=1.0), sample(5, 1, [2], reward=0.0),
        sample(6, 1, [3], reward=1.0), sample(7, 1, [10], reward=0.5),
    ]
    raw = [s.reward for s in samples]
    out_raw, out_rew = hooks.reward_post_process(args, samples)
    assert out_raw == raw
    assert [s.metadata["ascend_staleness"]["action"] for s in samples] == [
        "keep", "pad", "pad", "keep", "drop_stale", "drop_stale", "drop_stale", "drop_group"]
    assert [samples[i].metadata["ascend_staleness"]["reason"] for i in (1, 2)] == ["env_failed", "stale"]
    assert [s.remove_sample for s in samples] == [False, True, True, False, True, True, True, True]
    # the padded slots alias a valid rollout, so group normalisation sees only the valid rewards 1 and 0
    # (mean 0.5, unbiased std sqrt(0.5))
    valid = [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)]
    assert out_rew[0] == pytest.approx(valid[0], rel=1e-5) and out_rew[3] == pytest.approx(valid[1], rel=1e-5)
    assert samples[1].rollout_id == samples[0].rollout_id and samples[2].rollout_id == samples[3].rollout_id
    assert len({samples[0].rollout_id, samples[3].rollout_id}) == 2
    report = staleness_hook.last_staleness_report()
    assert (report["kept"], report["padded"], report["dropped"]) == (2, 2, 4)
    counts = ("stale", "env_failed", "dropped_groups", "dropped_group_members")
    assert tuple(report[k] for k in counts) == (4, 1, 1, 1)


def test_unversioned_samples_kept_or_refused():
    args = make_args(["staleness"], ascend_staleness_group_rule=False)
    samples = [sample(0, 0, []), sample(1, 0, [3])]
    staleness_hook.staleness_post_process(args, samples, [0.0, 0.0], [0.0, 0.0])
    assert staleness_hook.last_staleness_report()["unversioned"] == 1
    assert not samples[0].remove_sample
    runtime.reset()  # settings are validated once per process and selection
    with pytest.raises(ValueError, match="no weight_versions"):
        staleness_hook.staleness_post_process(
            make_args(["staleness"], ascend_staleness_unversioned="error"), [sample(0, 0, [])], [0.0], [0.0])
    runtime.reset()
    with pytest.raises(ValueError, match="index=0"):
        staleness_hook.staleness_post_process(args, [sample(0, 0, ["v1"])], [0.0], [0.0])

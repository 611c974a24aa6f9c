"""The dispatchers run contributions in declared order and thread values through chains."""

import argparse
import asyncio

import pytest
import torch

from slime_ascend import hooks
from slime_ascend.plugins import registry
from slime_ascend.plugins.base import Contribution, Plugin
from slime_ascend.plugins.registry import PluginError
from slime_ascend.plugins.settings import Setting, SettingsError

CALLS: list[str] = []


def adv_first(args, rollout_data):
    CALLS.append("first")
    rollout_data["advantages"] = [torch.ones(3)]
    rollout_data["returns"] = [torch.ones(3)]


def adv_scale(args, rollout_data):
    CALLS.append("scale")
    rollout_data["advantages"] = [a * args.ascend_t_scale for a in rollout_data["advantages"]]


def tis_half(args, *, pg_loss, loss_masks, **kw):
    return pg_loss * 0.5, [m * 0 + 1 for m in loss_masks], {"half": torch.tensor(1.0)}


def tis_mask_first(args, *, pg_loss, loss_masks, **kw):
    masks = [m.clone() for m in loss_masks]
    masks[0][0] = 0
    return pg_loss + 1, masks, {"masked": torch.tensor(1.0)}


async def gen_with_eval(args, sample, sampling_params, evaluation=False):
    return (sample, evaluation)


async def gen_without_eval(args, sample, sampling_params):
    return sample


def reward_double(args, samples, raw, rewards):
    return raw, [r * 2 for r in rewards]


def validate_scale(args, settings):
    if settings.scale == 13:
        raise SettingsError("ascend_t_scale=13: unlucky. Fix: use another value")


@pytest.fixture
def plugins(fresh_runtime, monkeypatch):
    CALLS.clear()
    monkeypatch.delenv("SLIME_ASCEND_PLUGINS", raising=False)
    m = __name__
    registry.register(Plugin(
        name="t-scale", description="x", requires=("t-base",),
        settings=(Setting("ascend_t_scale", float, 2.0, "scale"),),
        contributions=(Contribution("advantage", f"{m}.adv_scale", order=300),
                       Contribution("tis", f"{m}.tis_mask_first", order=200)),
        validate=f"{m}.validate_scale",
    ))
    registry.register(Plugin(
        name="t-base", description="x",
        contributions=(Contribution("advantage", f"{m}.adv_first", order=100),
                       Contribution("tis", f"{m}.tis_half", order=100),
                       Contribution("generate", f"{m}.gen_with_eval"),
                       Contribution("reward_post_process", f"{m}.reward_double")),
    ))
    registry.register(Plugin(name="t-gen2", description="x",
                             contributions=(Contribution("generate", f"{m}.gen_without_eval"),)))


def args_for(*names, **kw):
    return argparse.Namespace(ascend_plugins=list(names), **kw)


def test_advantage_chain_in_order_with_settings(plugins):
    data = {}
    hooks.advantage_function(args_for("t-scale", ascend_t_scale=3.0), data)
    assert CALLS == ["first", "scale"]
    assert torch.equal(data["advantages"][0], torch.full((3,), 3.0))


def test_tis_chain_threads_loss_masks_and_metrics(plugins):
    masks = [torch.ones(2), torch.ones(3)]
    loss, out_masks, metrics = hooks.tis_function(
        args_for("t-scale"), pg_loss=torch.tensor([4.0]), train_log_probs=None, rollout_log_probs=None,
        loss_masks=masks, total_lengths=[4, 5], response_lengths=[2, 3],
    )
    assert loss.item() == 3.0  # 4 * 0.5, then + 1
    assert out_masks[0].tolist() == [0, 1]
    assert set(metrics) == {"half", "masked"}


def test_generate_passes_evaluation_only_when_accepted(plugins):
    assert asyncio.run(hooks.generate(args_for("t-base"), "s", {}, evaluation=True)) == ("s", True)
    assert asyncio.run(hooks.generate(args_for("t-gen2"), "s", {}, evaluation=True)) == "s"


def test_missing_slot_explains(plugins):
    with pytest.raises(PluginError, match="no enabled plugin provides it"):
        hooks.loss_function(args_for("t-base"), None, None, None)


def test_validation_runs_with_real_args(plugins):
    with pytest.raises(SettingsError, match="unlucky"):
        hooks.advantage_function(args_for("t-scale", ascend_t_scale=13), {})
    with pytest.raises(SettingsError, match="ascend_t_scale='x'"):
        hooks.advantage_function(args_for("t-scale", ascend_t_scale="x"), {})


def test_env_and_yaml_must_agree(plugins, monkeypatch):
    monkeypatch.setenv("SLIME_ASCEND_PLUGINS", "t-base")
    with pytest.raises(PluginError, match="disagrees"):
        hooks.advantage_function(args_for("t-scale"), {})


class S:
    def __init__(self, reward, group, rollout):
        self.reward, self.group_index, self.rollout_id, self.index = reward, group, rollout, rollout

    def get_reward_value(self, args):
        return self.reward


def test_reward_post_process_counts_rollouts_once(plugins):
    args = args_for("t-base", advantage_estimator="grpo", rewards_normalization=True, grpo_std_normalization=False)
    # group 0: rollout 1 has two segments (reward 1), rollout 2 one sample (reward 0)
    samples = [S(1.0, 0, 1), S(1.0, 0, 1), S(0.0, 0, 2)]
    raw, rewards = hooks.reward_post_process(args, samples)
    assert raw == [1.0, 1.0, 0.0]
    # doubled to [2, 2, 0]; mean over rollouts = 1 (not 4/3 over samples)
    assert rewards == [1.0, 1.0, -1.0]

"""The ``compaction`` plugin declaration: settings match the generate function, the YAML, validation,
and the advantage chain composing with a base estimator at order 100."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
import yaml
from compaction_fakes import FakeEngine, make_tiny_tokenizer, memory_policy

from slime_ascend import config, hooks
from slime_ascend.compaction import generate as gen_mod
from slime_ascend.compaction.generate import SETTINGS_DEFAULTS, CompactionRuntime, CompactionSettings
from slime_ascend.compaction.plugin import PLUGIN
from slime_ascend.compat.sample import get_sample_class
from slime_ascend.plugins import registry, runtime
from slime_ascend.plugins.base import Contribution, Plugin
from slime_ascend.plugins.settings import SettingsError

TRAIN_KEYS = {"lambda_mode": "fixed", "lambda_alpha": 1.5, "critic_target": "decayed"}


def test_settings_cover_every_generate_key_with_the_same_defaults():
    declared = {s.key.removeprefix("ascend_compaction_"): s.default for s in PLUGIN.settings}
    assert declared == {**SETTINGS_DEFAULTS, **TRAIN_KEYS}


def test_contributions_and_orders():
    got = {(c.slot, c.order, c.target.rsplit(".", 1)[-1]) for c in PLUGIN.contributions}
    assert got == {
        ("generate", 500, "generate"),
        ("reward_post_process", 500, "share_final_reward"),
        ("advantage", 50, "prepare_segments"),
        ("advantage", 150, "base_advantages"),
        ("advantage", 300, "decay_advantages"),
    }
    for c in PLUGIN.contributions:
        assert callable(c.load())
    assert PLUGIN.patches == ()  # round_number + rollout_ids already reach the trainer


def test_entry_point_is_installed():
    assert registry.available()["compaction"] is PLUGIN


def test_generated_yaml_sets_hooks_and_reproduces_default_settings(fresh_runtime):
    text = config.build(["compaction"]).yaml_text
    values = yaml.safe_load(text)
    assert values["ascend_plugins"] == ["compaction"]
    assert values["custom_generate_function_path"] == "slime_ascend.hooks.generate"
    assert values["custom_advantage_function_path"] == "slime_ascend.hooks.advantage_function"
    assert values["custom_reward_post_process_path"] == "slime_ascend.hooks.reward_post_process"
    args = SimpleNamespace(**values)
    assert CompactionSettings.from_args(args) == CompactionSettings.from_args(SimpleNamespace())
    view = runtime.settings(args, "compaction")
    assert view.critic_target == "decayed" and view.lambda_mode == "fixed"


@pytest.mark.parametrize(
    "key, value",
    [("context_budget", 0), ("trigger_tokens", -1), ("max_turns", 0), ("lambda_mode", "adaptive"),
     ("critic_target", "both"), ("env_kwargs", "x=1")],
)
def test_bad_settings_are_rejected(fresh_runtime, key, value):
    args = SimpleNamespace(ascend_plugins=["compaction"], **{f"ascend_compaction_{key}": value})
    with pytest.raises(SettingsError, match=f"ascend_compaction_{key}"):
        runtime.active(args)


@pytest.mark.parametrize(
    "extra, match",
    [({"advantage_estimator": "dapo"}, "not supported"),
     ({"custom_convert_samples_to_train_data_path": "my.converter"}, "reward post-process"),
     ({"custom_pg_loss_reducer_function_path": "my.reducer"}, "rollout_mask_sums")],
)
def test_validate_rejects_settings_that_break_credit(fresh_runtime, extra, match):
    args = SimpleNamespace(ascend_plugins=["compaction"], advantage_estimator="ppo")
    args.__dict__.update(extra)
    with pytest.raises(SettingsError, match=match):
        runtime.active(args)


def test_validate_accepts_every_slime_estimator(fresh_runtime):
    for est in ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"):
        runtime.reset()
        state = runtime.active(SimpleNamespace(ascend_plugins=["compaction"], advantage_estimator=est,
                                               custom_convert_samples_to_train_data_path=None))
        assert list(state.selection.names) == ["compaction"], est  # validated, and nothing dropped
        assert state.settings["compaction"]["ascend_compaction_lambda_mode"] == "fixed", est


# ----------------------------------------------------------------------------------------------
# composing with a base estimator at order 100
# ----------------------------------------------------------------------------------------------

CALLS: list[str] = []


def fake_base(args, rollout_data):
    CALLS.append("base100")
    rollout_data["advantages"] = [torch.ones(len(m)) for m in rollout_data["loss_masks"]]
    rollout_data["returns"] = [torch.ones(len(m)) for m in rollout_data["loss_masks"]]
    rollout_data["gae_lambdas"] = [0.5] * len(rollout_data["loss_masks"])


FAKE = Plugin(name="fakebase", description="test base estimator",
              contributions=(Contribution("advantage", f"{__name__}.fake_base", order=100),))


def _two_segments():
    return {
        "rollout_ids": [3, 3],
        "round_number": [1, 0],
        "loss_masks": [torch.tensor([1, 0, 1]), torch.tensor([1, 1])],
        "response_lengths": [3, 2],
        "total_lengths": [5, 4],
        "rewards": [1.0, 1.0],
        "values": [torch.zeros(3), torch.zeros(2)],
        "kl": [torch.zeros(3), torch.zeros(2)],
    }


def test_chain_keeps_an_earlier_base_estimator_and_decays_it(fresh_runtime):
    registry.register(FAKE)
    CALLS.clear()
    data = _two_segments()
    args = SimpleNamespace(ascend_plugins=["fakebase", "compaction"], advantage_estimator="ppo", gamma=1.0, lambd=1.0)
    hooks.advantage_function(args, data)
    assert CALLS == ["base100"]
    # segment 0 (second entry) has 2 trainable tokens after it: (1.0 * 0.5) ** 2
    assert data["compaction_decay"] == pytest.approx([1.0, 0.25])
    assert data["advantages"][1].tolist() == pytest.approx([0.25, 0.25])
    assert data["returns"][1].tolist() == pytest.approx([0.25, 0.25])


def test_chain_alone_computes_its_own_base(fresh_runtime):
    data = _two_segments()
    args = SimpleNamespace(ascend_plugins=["compaction"], advantage_estimator="ppo", gamma=1.0, lambd=0.5, kl_coef=0.0)
    hooks.advantage_function(args, data)
    # V = 0: reward 1 discounted by 0.5 per trainable token to the end of the concatenated trajectory
    assert data["advantages"][1].tolist() == pytest.approx([0.5**3, 0.5**2])
    assert data["advantages"][0].tolist() == pytest.approx([0.5, 0.0, 1.0])


def test_sao_and_compaction_compose_when_sao_is_installed(fresh_runtime):
    assert "sao" in registry.available(), registry.broken().get("sao", "the sao plugin is not registered")
    selection = registry.resolve_selection(["sao", "compaction"])
    orders = [c.order for _, c in selection.slots["advantage"]]
    assert orders == sorted(orders) and 100 in orders and 300 in orders


# ----------------------------------------------------------------------------------------------
# rollout side through the dispatchers
# ----------------------------------------------------------------------------------------------


def test_generate_and_reward_post_process_through_dispatchers(fresh_runtime):
    tok = make_tiny_tokenizer()
    gen_mod.set_runtime_override(CompactionRuntime(tok, FakeEngine(tok, memory_policy)))
    try:
        args = SimpleNamespace(ascend_plugins=["compaction"], ascend_compaction_context_budget=3000,
                               ascend_compaction_trigger_tokens=1200, ascend_compaction_env_kwargs={"num_facts": 10},
                               advantage_estimator="grpo", rewards_normalization=True, grpo_std_normalization=False,
                               reward_key=None)
        Sample = get_sample_class()
        segs = asyncio.run(hooks.generate(args, Sample(index=0, group_index=0, prompt="p"), {"max_new_tokens": 400}))
        assert len(segs) >= 2 and {s.rollout_id for s in segs} == {0}
        other = Sample(index=1, group_index=0, rollout_id=1, reward=0.0, metadata={})
        segs[0].reward = 0.3  # e.g. a reward model scored a non-final segment: the final reward wins
        raw, rewards = hooks.reward_post_process(args, [*segs, other])
        final = segs[-1].reward
        assert raw == [final] * len(segs) + [0.0]
        # mean over the two rollouts, each counted once
        assert rewards == pytest.approx([final - final / 2] * len(segs) + [-final / 2])
    finally:
        gen_mod.set_runtime_override(None)

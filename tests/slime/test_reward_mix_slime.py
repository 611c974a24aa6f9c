"""reward-mix on real slime: a failed member through slime's samples -> train data conversion and its advantage
path, and rule terms against slime's own rule functions on a mixed dataset."""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
import types

import pytest
import torch

from conftest import single_process_megatron
from slime_ascend import hooks as dispatch
from slime_ascend.reward_mix import hooks

pytestmark = pytest.mark.slime

JUDGED = [1, 0, 1, None, 0, 1]  # sample 3's judge fails


def _judge(args, sample, **_):
    if JUDGED[sample.index] is None:
        raise TimeoutError("judge did not answer")
    return JUDGED[sample.index]


def _args(**kw):
    base = dict(ascend_plugins=["reward-mix"], ascend_reward_penalties=[],
                ascend_reward_components=[{"name": "judge", "path": "tests_reward_terms.judge"}],
                advantage_estimator="grpo", rewards_normalization=True, grpo_std_normalization=True, reward_key=None,
                n_samples_per_prompt=6, rollout_batch_size=1, rm_type="math", custom_rm_path="slime_ascend.hooks.reward_model")
    base.update(kw)
    return argparse.Namespace(**base)


def _manager(args, post_process):
    from slime.ray.rollout import RolloutManager

    cls = getattr(RolloutManager, "__ray_actor_class__", RolloutManager)
    fake = argparse.Namespace(args=args, custom_convert_samples_to_train_data_func=None,
                              custom_reward_post_process_func=post_process)
    fake._post_process_rewards = functools.partial(cls._post_process_rewards, fake)
    return cls, fake


def _samples(rewards):
    from slime.utils.types import Sample

    return [Sample(index=i, group_index=0, tokens=[1, 2, 3, 4], response_length=2, reward=r,
                   status=Sample.Status.COMPLETED) for i, r in enumerate(rewards)]


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "reinforce_plus_plus_baseline"])
def test_failed_member_left_out_of_slimes_group_normalisation_and_advantages(monkeypatch, fresh_runtime, estimator):
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns

    monkeypatch.setitem(sys.modules, "tests_reward_terms", types.SimpleNamespace(judge=_judge))
    hooks.reset()
    args = _args(advantage_estimator=estimator)
    samples = _samples([None] * 6)
    for s in samples:
        s.reward = asyncio.run(hooks.reward(args, s))
    cls, fake = _manager(args, dispatch.reward_post_process)
    data = cls._convert_samples_to_train_data(fake, samples)

    # reference: slime's own normalisation of a group of the five scored members (n_samples_per_prompt = 5)
    cls5, slime_default = _manager(_args(advantage_estimator=estimator, n_samples_per_prompt=5), None)
    _, reference = slime_default._post_process_rewards(_samples([1, 0, 1, 0, 1]))
    assert [data["rewards"][i] for i in (0, 1, 2, 4, 5)] == pytest.approx(reference, abs=1e-6)
    assert data["rewards"][3] == 0.0
    assert [sum(m) for m in data["loss_masks"]] == [2, 2, 2, 0, 2, 2]  # the failed member trains nothing
    if estimator != "reinforce_plus_plus_baseline":  # divided by the std of the five
        assert [round(data["rewards"][i], 4) for i in (0, 1, 2, 4, 5)] == [0.7303, -1.0954, 0.7303, -1.0954, 0.7303]

    # slime's train side (normalize_advantages: masked whitening over the batch): the failed member's reward,
    # whatever it is, does not reach the others' advantages
    def advantages(failed_reward):
        rollout = {"rewards": [*data["rewards"][:3], failed_reward, *data["rewards"][4:]],
                   "loss_masks": [torch.tensor(m) for m in data["loss_masks"]],
                   "response_lengths": data["response_lengths"], "total_lengths": [4] * 6,
                   "log_probs": [torch.zeros(2) for _ in range(6)]}
        train_args = argparse.Namespace(**{**vars(args), "kl_coef": 0.0, "use_rollout_logprobs": False,
                                           "custom_advantage_function_path": None, "use_opd": False,
                                           "normalize_advantages": True, "kl_loss_type": "k1"})
        compute_advantages_and_returns(train_args, rollout)
        return [x for i in (0, 1, 2, 4, 5) for x in rollout["advantages"][i].tolist()]

    with single_process_megatron():
        whitened = advantages(0.0)
        assert whitened == pytest.approx(advantages(100.0), abs=1e-6)
    # by hand: the ten scored tokens (two per member), mean m, unbiased variance over tokens
    tokens = [data["rewards"][i] for i in (0, 1, 2, 4, 5) for _ in range(2)]
    m = sum(tokens) / len(tokens)
    var = sum((t - m) ** 2 for t in tokens) / (len(tokens) - 1)
    assert whitened == pytest.approx([(t - m) / (var + 1e-8) ** 0.5 for t in tokens], abs=1e-5)


MIXED = [  # (response, label, the sample's own metadata / custom_rm_path)
    ("the answer is 42", "42", {"rm_type": "f1"}, None),
    ("\\boxed{42} is it", "42", {"rm_type": "math"}, None),
    ("the answer is 42", "42", {}, None),
    ("\\boxed{42} is it", "42", {"rm_type": "f1", "note": "kept"}, "tests_reward_rm.boom"),
]


def test_rule_terms_compute_their_declared_rule_whatever_the_sample_says(monkeypatch, fresh_runtime):
    from slime.rollout.rm_hub import f1_score, grade_answer_verl
    from slime.utils.types import Sample

    def boom(args, sample, **_):
        raise AssertionError("the sample's custom_rm_path must not be called by a rule term")

    monkeypatch.setitem(sys.modules, "tests_reward_rm", types.SimpleNamespace(boom=boom))
    hooks.reset()
    args = _args(ascend_reward_components=[{"name": "m", "rm_type": "math"}, {"name": "f", "rm_type": "f1"}],
                 rm_type="deepscaler")
    for response, label, metadata, path in MIXED:
        sample = Sample(index=0, prompt="q", response=response, label=label, metadata=dict(metadata),
                        custom_rm_path=path)
        total = asyncio.run(hooks.reward(args, sample))
        expected = {"m": 1 if grade_answer_verl(response, label) else 0, "f": f1_score(response, label)[0]}
        assert sample.metadata["reward_mix"]["components"] == expected, (metadata, path)
        assert total == pytest.approx(expected["m"] + expected["f"])
        # the user's sample keeps its own rule and path
        assert {k: v for k, v in sample.metadata.items() if k != "reward_mix"} == metadata
        assert sample.custom_rm_path == path
    # the two rules disagree on these responses, so a term that computed the other rule would be caught
    assert grade_answer_verl(MIXED[0][0], "42") != (f1_score(MIXED[0][0], "42")[0] > 0)
    assert f1_score(MIXED[1][0], "42")[0] == 0 and grade_answer_verl(MIXED[1][0], "42")

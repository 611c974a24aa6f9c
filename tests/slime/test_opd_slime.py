"""The ``opd`` plugin against real slime: same teacher_log_probs as slime's own OPD hooks, same
advantages as slime's ``apply_opd_kl_to_advantages`` for one coefficient (and through slime's own
``compute_advantages_and_returns`` with our dispatcher), and samples that flow through slime's
``_convert_samples_to_train_data`` / ``_split_train_data_by_dp`` with ``teacher_log_probs`` intact."""

from __future__ import annotations

import argparse
import asyncio
import functools
import random

import pytest

from conftest import single_process_megatron
import torch

from slime_ascend.opd import hooks as hooks
from slime_ascend.opd.plugin import PLUGIN

pytestmark = [pytest.mark.slime, pytest.mark.usefixtures("opd_state")]

ONE_TEACHER = [{"name": "t", "checkpoint_dir": "/nonexistent/t", "domains": ["math"], "url": "http://127.0.0.1:1"}]


def make_args(**overrides) -> argparse.Namespace:
    values = {s.key: s.default for s in PLUGIN.settings}
    values.update(dict(PLUGIN.slime_args))
    values.update(
        ascend_plugins=["opd"],
        ascend_opd_teachers=ONE_TEACHER,
        ascend_opd_same_origin_check=False,
        opd_teacher_load=None,
        rollout_temperature=1.0,
        use_rollout_logprobs=False,
        hf_checkpoint=None,
        reward_key=None,
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def make_samples(n: int, seed: int = 0):
    from slime.utils.types import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt_len, resp_len = rng.randint(2, 6), rng.randint(1, 7)
        s = Sample(index=i, tokens=[rng.randrange(1000) for _ in range(prompt_len + resp_len)],
                   response_length=resp_len)
        s.metadata = {"domain": "math"}
        s.rollout_log_probs = [-rng.random() for _ in range(resp_len)]
        s.status = Sample.Status.COMPLETED
        out.append(s)
    return out


@pytest.fixture(scope="module")
def teacher_url():
    from slime_ascend.rollout.torch_engine.engine import TorchEngine

    with TorchEngine(seed=7).start_in_thread() as url:
        yield url


def test_teacher_log_probs_equal_slimes_own_opd_hooks(teacher_url):
    from slime.rollout.on_policy_distillation import post_process_rewards, reward_func

    teachers = [dict(ONE_TEACHER[0], url=teacher_url)]
    args = make_args(ascend_opd_teachers=teachers, rm_url=teacher_url + "/generate")
    theirs, ours = make_samples(6), make_samples(6)

    async def score():
        for s in theirs:
            s.reward = await reward_func(args, s)
        rewards = await asyncio.gather(*(hooks.teacher_reward(args, s) for s in ours))
        for s, r in zip(ours, rewards):
            s.reward = r

    asyncio.run(score())
    post_process_rewards(args, theirs)
    raw, _ = hooks.fill_teacher_log_probs(args, ours, [s.get_reward_value(args) for s in ours], [0.0] * 6)
    assert raw == [0.0] * 6  # a task reward, not slime's teacher JSON
    for a, b in zip(theirs, ours):
        assert b.teacher_log_probs.dtype == a.teacher_log_probs.dtype == torch.float32
        assert b.teacher_log_probs.shape == a.teacher_log_probs.shape == (a.response_length,)
        torch.testing.assert_close(b.teacher_log_probs, a.teacher_log_probs, rtol=0, atol=0)


def _rollout_data(seed: int = 0, n: int = 6):
    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(1, 9, (n,), generator=g)]
    student = [-torch.rand(m, generator=g) * 2 for m in lens]
    teacher = [s + 0.4 * torch.randn(s.shape, generator=g) for s in student]
    adv = [torch.randn(m, generator=g) for m in lens]
    return {"log_probs": student, "teacher_log_probs": teacher, "advantages": adv, "returns": list(adv)}


@pytest.mark.parametrize("coef", [0.0, 0.3, 1.0, 2.5])
def test_advantage_equals_slimes_apply_opd_kl_to_advantages(coef):
    from slime.backends.megatron_utils.loss import apply_opd_kl_to_advantages

    theirs, ours = _rollout_data(), _rollout_data()
    slime_args = argparse.Namespace(use_opd=True, opd_type="sglang", opd_kl_coef=coef)
    advantages = list(theirs["advantages"])
    apply_opd_kl_to_advantages(slime_args, theirs, advantages, theirs["log_probs"])
    args = make_args(ascend_opd_teachers=[dict(ONE_TEACHER[0], coef=coef)])
    hooks.opd_advantage(args, ours)
    for a, b in zip(advantages, ours["advantages"]):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    for a, b in zip(theirs["opd_reverse_kl"], ours["opd_reverse_kl"]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.fixture(scope="module")
def megatron_parallel_state():
    with single_process_megatron() as state:
        yield state


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_plus_plus_baseline"])
def test_through_slimes_compute_advantages_with_our_dispatcher(megatron_parallel_state, estimator):
    """slime with --opd-kl-coef c vs slime with our hook paths (opd_kl_coef 0, teacher coef c)."""
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns

    c = 0.7
    common = dict(advantage_estimator=estimator, kl_coef=0.0, use_rollout_logprobs=False, normalize_advantages=True,
                  use_opd=True, opd_type="sglang", gamma=1.0, lambd=1.0, kl_loss_type="k1")

    def data():
        d = _rollout_data(seed=3)
        del d["advantages"], d["returns"]
        n = len(d["log_probs"])
        d["rewards"] = [float(x) for x in torch.linspace(-1, 1, n)]
        d["response_lengths"] = [len(x) for x in d["log_probs"]]
        d["total_lengths"] = [m + 3 for m in d["response_lengths"]]
        d["loss_masks"] = [torch.ones(m, dtype=torch.int32) for m in d["response_lengths"]]
        return d

    theirs = data()
    compute_advantages_and_returns(argparse.Namespace(**common, opd_kl_coef=c, custom_advantage_function_path=None),
                                   theirs)
    ours = data()
    args = make_args(**common, opd_kl_coef=0.0, custom_advantage_function_path="slime_ascend.hooks.advantage_function",
                     ascend_opd_teachers=[dict(ONE_TEACHER[0], coef=c)])
    compute_advantages_and_returns(args, ours)
    for a, b in zip(theirs["advantages"], ours["advantages"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for a, b in zip(theirs["returns"], ours["returns"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_samples_flow_through_slimes_converter_and_dp_split():
    from slime.ray.rollout import RolloutManager as RolloutActor

    import slime_ascend.hooks as dispatch

    RolloutManager = RolloutActor.__ray_actor_class__  # the plain class behind @ray.remote

    args = make_args(
        advantage_estimator="grpo", rewards_normalization=True, grpo_std_normalization=True,
        n_samples_per_prompt=1, rollout_batch_size=6, global_batch_size=6, micro_batch_size=1,
        use_dynamic_batch_size=False, max_tokens_per_gpu=None, balance_data=False, balance_by_flops=False,
        rollout_top_p=1.0, use_rollout_routing_replay=False, rollout_data_transport="object-store",
    )
    samples = make_samples(6, seed=4)
    expected = {}
    for s in samples:  # what the reward model leaves behind
        lp = [-0.1 * (k + 1) - 0.01 * s.index for k in range(s.response_length)]
        s.metadata.update(opd_teacher="t", opd_teacher_log_probs=lp)
        s.reward = 0.0
        expected[s.index] = lp
    fake = argparse.Namespace(args=args, custom_convert_samples_to_train_data_func=None,
                              custom_reward_post_process_func=dispatch.reward_post_process,
                              train_parallel_config={"dp_size": 2, "cp_size": 1, "vpp_size": 1,
                                                     "microbatch_group_size_per_vp_stage": 1})
    fake._post_process_rewards = functools.partial(RolloutManager._post_process_rewards, fake)
    train_data = RolloutManager._convert_samples_to_train_data(fake, samples)
    for t, i in zip(train_data["teacher_log_probs"], train_data["sample_indices"]):
        assert t.tolist() == pytest.approx(expected[i])
    assert train_data["metadata"][0] == {"opd_teacher": "t", "opd_coef": 1.0}

    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        refs = RolloutManager._split_train_data_by_dp(fake, train_data)
        seen = 0
        for box in refs:
            part = ray.get(box.inner)
            for idx, t, m in zip(part["sample_indices"], part["teacher_log_probs"], part["response_lengths"]):
                assert t.dtype == torch.float32 and t.shape == (m,)
                assert t.tolist() == pytest.approx(expected[int(idx)])
                seen += 1
        assert seen == 6
    finally:
        ray.shutdown()

"""sao's advantage hook: against a slow reference loop, CP emulation, actor vs critic lambdas."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend.algorithms.cp import cp_local_length, cp_slice
from slime_ascend.algorithms.gae import cp_skip_observation_gae, length_adaptive_lambdas
from slime_ascend.patch.train import critic_advantage_function as caf
from slime_ascend.sao import advantage
from slime_ascend.sao.plugin import PLUGIN


def reference(values, reward, kl, mask, gamma, lam, kl_coef):
    """Slow, obviously right: walk the action tokens backwards, skipping observations."""
    n = len(values)
    r = [-kl_coef * float(k) for k in kl]
    acts = [t for t in range(n) if mask[t]]
    if acts:
        r[acts[-1]] += reward
    adv, ret = [0.0] * n, [0.0] * n
    a = 0.0
    for j in reversed(range(len(acts))):
        t = acts[j]
        nxt = float(values[acts[j + 1]]) if j + 1 < len(acts) else 0.0
        a = r[t] + gamma * nxt - float(values[t]) + gamma * lam * a
        adv[t], ret[t] = a, a + float(values[t])
    return torch.tensor(adv), torch.tensor(ret)


def make_batch(seed, n=4, max_len=40):
    g = torch.Generator().manual_seed(seed)
    resp = [int(x) for x in torch.randint(1, max_len, (n,), generator=g)]
    prompts = [int(x) for x in torch.randint(1, 9, (n,), generator=g)]
    values = [torch.randn(m, generator=g) for m in resp]
    kl = [torch.randn(m, generator=g) * 0.1 for m in resp]
    masks = [(torch.rand(m, generator=g) < 0.7).to(torch.int32) for m in resp]
    rewards = [float(x) for x in torch.randn(n, generator=g)]
    totals = [p + m for p, m in zip(prompts, resp)]
    return values, kl, masks, rewards, totals, resp


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), gamma=st.sampled_from([1.0, 0.99, 0.5]), kl_coef=st.sampled_from([0.0, 0.3]),
       alpha=st.sampled_from([1.5, 0.2, 10.0]))
def test_cp_skip_observation_gae_matches_reference(seed, gamma, kl_coef, alpha):
    values, kl, masks, rewards, totals, resp = make_batch(seed)
    lams = length_adaptive_lambdas(masks, alpha)
    adv, ret = cp_skip_observation_gae(values, kl, rewards, masks, totals, resp, gamma=gamma, lambdas=lams,
                                       kl_coef=kl_coef)
    for i in range(len(values)):
        ea, er = reference(values[i], rewards[i], kl[i], masks[i].tolist(), gamma, lams[i], kl_coef)
        torch.testing.assert_close(adv[i], ea, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ret[i], er, rtol=1e-4, atol=1e-4)


def test_policy_lambda_is_length_adaptive_over_trainable_tokens():
    masks = [torch.tensor([1, 0, 0, 1, 1]), torch.tensor([0, 0]), torch.ones(100, dtype=torch.int32)]
    lams = length_adaptive_lambdas(masks, 1.5)
    assert lams[0] == pytest.approx(1 - 1 / (1.5 * 3))  # observations do not count
    assert lams[1] == 0.0
    assert lams[2] == pytest.approx(1 - 1 / 150)
    # rollout totals (compaction) win over the sample's own count
    assert length_adaptive_lambdas(masks, 1.5, [300, 300, 300]) == [pytest.approx(1 - 1 / 450)] * 3
    with pytest.raises(ValueError, match="rollout_trainable_tokens"):
        length_adaptive_lambdas(masks, 1.5, [1])


def _emulated_gather(local_by_rank, totals, resp, cp_size):
    """all_gather stand-in: every rank's padded concatenation, as cp_full_vectors lays it out."""
    lens = [[cp_local_length(r, cp_size, t, n) for t, n in zip(totals, resp)] for r in range(cp_size)]
    width = max(sum(row) for row in lens)
    padded = {kind: [torch.nn.functional.pad(torch.cat(local_by_rank[kind][r]), (0, width - sum(lens[r])))
                     for r in range(cp_size)] for kind in local_by_rank}

    def gather(x):
        for kind, rows in padded.items():
            if any(torch.equal(x, row) for row in rows):
                return [row.clone() for row in rows]
        raise AssertionError("unexpected tensor gathered")

    return gather


@pytest.mark.parametrize("cp_size", [2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cp_emulation_gives_identical_results(cp_size, seed):
    values, kl, masks, rewards, totals, resp = make_batch(seed, n=5, max_len=60)
    lams = length_adaptive_lambdas(masks, 1.5)
    full_adv, full_ret = cp_skip_observation_gae(values, kl, rewards, masks, totals, resp, gamma=1.0, lambdas=lams,
                                                 kl_coef=0.1)
    local = {kind: [[cp_slice(x, r, cp_size, t, n) for x, t, n in zip(src, totals, resp)] for r in range(cp_size)]
             for kind, src in (("values", values), ("kl", kl))}
    gather = _emulated_gather(local, totals, resp, cp_size)
    for r in range(cp_size):
        adv, ret = cp_skip_observation_gae(local["values"][r], local["kl"][r], rewards, masks, totals, resp,
                                           gamma=1.0, lambdas=lams, kl_coef=0.1, cp_rank=r, cp_size=cp_size,
                                           all_gather=gather)
        for i in range(len(values)):
            assert torch.equal(adv[i], cp_slice(full_adv[i], r, cp_size, totals[i], resp[i]))
            assert torch.equal(ret[i], cp_slice(full_ret[i], r, cp_size, totals[i], resp[i]))


def test_cp_skip_observation_gae_rejects_bad_input():
    values, kl, masks, rewards, totals, resp = make_batch(0)
    with pytest.raises(ValueError, match="kl has"):
        cp_skip_observation_gae(values, kl[:-1], rewards, masks, totals, resp, gamma=1.0, lambdas=1.0)
    bad = list(masks)
    bad[0] = torch.ones(len(masks[0]) + 1)
    with pytest.raises(ValueError, match="full response length"):
        cp_skip_observation_gae(values, kl, rewards, bad, totals, resp, gamma=1.0, lambdas=1.0)


# ---- the hook itself -------------------------------------------------------------------------


@pytest.fixture
def sao_args(fresh_runtime, monkeypatch):
    monkeypatch.delenv("SLIME_ASCEND_PLUGINS", raising=False)
    values = {s.key: s.default for s in PLUGIN.settings}
    values.update(ascend_plugins=["sao"], ascend_sao_freeze_critic_attention=False, kl_coef=0.0,
                  advantage_estimator="ppo", n_samples_per_prompt=1, use_tis=False)
    return argparse.Namespace(**values)


def rollout_data(seed=0):
    values, kl, masks, rewards, totals, resp = make_batch(seed)
    return dict(values=values, kl=kl, loss_masks=masks, rewards=rewards, total_lengths=totals, response_lengths=resp)


@pytest.fixture
def patch_marked_applied(monkeypatch):
    monkeypatch.setattr(type(caf.PATCH), "applied", property(lambda self: True))


def test_hook_actor_uses_length_adaptive_lambda(sao_args, patch_marked_applied):
    data = rollout_data(3)
    advantage.skip_observation_advantages(sao_args, data)
    lams = length_adaptive_lambdas(data["loss_masks"], 1.5)
    assert data["gae_lambdas"] == lams
    for i in range(len(lams)):
        ea, _ = reference(data["values"][i], data["rewards"][i], data["kl"][i], data["loss_masks"][i].tolist(), 1.0,
                          lams[i], 0.0)
        torch.testing.assert_close(data["advantages"][i], ea, rtol=1e-4, atol=1e-4)


def test_hook_critic_uses_critic_lambda_and_returns_are_targets(sao_args):
    data = rollout_data(4)
    sao_args.ascend_sao_critic_lambda = 1.0
    with caf.critic_pass():
        advantage.skip_observation_advantages(sao_args, data)
    assert data["gae_lambdas"] == [1.0] * len(data["values"])
    for i, m in enumerate(data["loss_masks"]):
        acts = m.nonzero().flatten().tolist()
        if acts:  # lambda = 1, gamma = 1, no KL: every action token's target is the final reward
            torch.testing.assert_close(data["returns"][i][acts], torch.full((len(acts),), data["rewards"][i]))
        assert torch.all(data["returns"][i][m == 0] == 0)


def test_hook_refuses_without_the_patch_or_values(sao_args):
    data = rollout_data(5)
    with pytest.raises(RuntimeError, match="train.critic_advantage_function"):
        advantage.skip_observation_advantages(sao_args, data)
    del data["values"]
    with caf.critic_pass(), pytest.raises(ValueError, match="advantage-estimator ppo"):
        advantage.skip_observation_advantages(sao_args, data)


def test_dispatcher_runs_sao_then_later_chain_steps(sao_args, patch_marked_applied):
    from slime_ascend import hooks

    data = rollout_data(6)
    hooks.advantage_function(sao_args, data)
    assert len(data["advantages"]) == len(data["values"]) and not math.isnan(float(data["advantages"][0].sum()))

"""A tiny torch actor-critic on CPU run through sao's real pieces: the two critic runtime patches
(installed on a stand-in shaped like slime's actor module), the advantage dispatcher with sao's
skip-observation GAE, the clipped value loss and the DIS policy loss."""

from __future__ import annotations

import argparse
import copy

import pytest
import sao_toy_actor
import torch

from slime_ascend import hooks
from slime_ascend.algorithms.masks import DIS_PRESETS
from slime_ascend.patch.train import critic_advantage_function as caf
from slime_ascend.patch.train import critic_train_iters as cti
from slime_ascend.sao import critic, freeze
from slime_ascend.sao import loss as sao_loss
from slime_ascend.sao.plugin import PLUGIN

T = 10
MASK = torch.tensor([1, 1, 0, 0, 1, 1, 1, 0, 1, 1])  # 0 = observation token (not sampled by the policy)
VOCAB = 3
B = 64


class Net(torch.nn.Module):
    def __init__(self, out: int):
        super().__init__()
        self.self_attention = torch.nn.Linear(T, 16)
        self.mlp = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, out)

    def forward(self) -> torch.Tensor:  # [T, out]: one row per position (the "state")
        h = torch.tanh(self.self_attention(torch.eye(T)))
        return self.head(torch.tanh(self.mlp(h)))


class Scheduler:
    def __init__(self):
        self.num_steps = 0
        self.calls = 0

    def step(self, increment):
        self.num_steps += increment
        self.calls += 1


@pytest.fixture
def setup(fresh_runtime, monkeypatch):
    monkeypatch.delenv("SLIME_ASCEND_PLUGINS", raising=False)
    values = {s.key: s.default for s in PLUGIN.settings}
    values.update(ascend_plugins=["sao"], advantage_estimator="ppo", n_samples_per_prompt=1, use_tis=False,
                  kl_coef=0.0, value_clip=0.2, megatron_config_path=None, freeze_params_name_list=None,
                  ascend_sao_freeze_critic_attention=False, loss_type="custom_loss")
    args = argparse.Namespace(**values)
    modules = {cti.ACTOR: sao_toy_actor}
    originals = {n: getattr(sao_toy_actor, n) for n in ("forward_only", "compute_advantages_and_returns", "train")}
    train_critic = sao_toy_actor.MegatronTrainRayActor.train_critic
    yield args, modules
    cti.PATCH.remove()
    caf.PATCH.remove()
    assert sao_toy_actor.MegatronTrainRayActor.train_critic is train_critic  # removal restores
    assert not hasattr(sao_toy_actor.train, "__wrapped__")
    for n, f in originals.items():
        setattr(sao_toy_actor, n, f)


def install(args, modules):
    from slime_ascend.plugins import runtime

    s = runtime.settings(args, "sao")
    args.critic_train_iters, args.critic_train_iters_lr_schedule = s.critic_iters, s.critic_lr_schedule
    cti.PATCH.install(args, modules=modules)
    caf.PATCH.install(args, modules=modules)


def sample(policy: Net, g: torch.Generator):
    with torch.no_grad():
        logp = torch.log_softmax(policy(), dim=-1)  # [T, V]
    tokens = torch.multinomial(logp.exp(), B, replacement=True, generator=g).T  # [B, T]
    tokens = torch.where(MASK.bool(), tokens, torch.zeros_like(tokens))  # observations are fixed tokens
    rollout_lp = logp.gather(1, tokens.T).T * MASK  # [B, T]
    reward = ((tokens == 2) & MASK.bool()).sum(1).float() / MASK.sum()
    return tokens, rollout_lp, reward


def run(args, modules, iterations, seed=0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    policy, value_net = Net(VOCAB), Net(1)
    for name in freeze.matching_names([n for n, _ in value_net.named_parameters()], ["self_attention"]):
        value_net.get_parameter(name).requires_grad = False  # slime's freeze rule (re.search), before the optimizer
    frozen0 = {n: p.detach().clone() for n, p in value_net.named_parameters() if not p.requires_grad}
    critic_opt = torch.optim.Adam([p for p in value_net.parameters() if p.requires_grad], lr=3e-2)
    policy_opt = torch.optim.Adam(policy.parameters(), lr=3e-2)
    scheduler = Scheduler()
    log = {"value_loss": [], "reward": [], "critic_steps": 0, "scheduler": scheduler}

    def forward_only(fn, a, model, data_iterator, num_microbatches):
        with torch.no_grad():
            v = model().squeeze(-1)
        return {"values": [v.clone() for _ in range(B)]}

    def compute_advantages_and_returns(a, data):  # slime: kl first, then the custom advantage function
        data["kl"] = [torch.zeros(T) for _ in range(B)]
        hooks.advantage_function(a, data)

    def train(rollout_id, model, optimizer, opt_param_scheduler, data_iterator, num_microbatches, global_batch_sizes):
        data = data_iterator[0]
        mask = torch.cat(data["loss_masks"])
        v = model().squeeze(-1).repeat(B)
        loss, _ = sao_loss.value_loss(v, torch.cat(data["values"]), torch.cat(data["returns"]),
                                      lambda x: (x * mask).sum() / mask.sum(), a_value_clip)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        opt_param_scheduler.step(increment=global_batch_sizes[0])
        log["critic_steps"] += 1
        log["value_loss"].append(float(loss.detach()))

    a_value_clip = args.value_clip
    sao_toy_actor.forward_only = forward_only
    sao_toy_actor.compute_advantages_and_returns = compute_advantages_and_returns
    sao_toy_actor.train = train
    install(args, modules)
    actor = sao_toy_actor.MegatronTrainRayActor(args, value_net, critic_opt, scheduler)

    behaviour = copy.deepcopy(policy)  # one policy version stale, like train_async
    for it in range(iterations):
        tokens, rollout_lp, reward = sample(behaviour, g)
        behaviour.load_state_dict(policy.state_dict())
        data = dict(rewards=reward.tolist(), loss_masks=[MASK.clone() for _ in range(B)],
                    total_lengths=[T + 1] * B, response_lengths=[T] * B)
        out = actor.train_critic(it, data)
        assert cti.last_passes == args.critic_train_iters
        actor_data = dict(data, values=out["values"])
        for k in ("advantages", "returns", "gae_lambdas"):
            actor_data.pop(k)
        compute_advantages_and_returns(args, actor_data)  # the actor: outside train_critic
        assert actor_data["gae_lambdas"] == [pytest.approx(1 - 1 / (1.5 * int(MASK.sum())))] * B
        train_lp = torch.log_softmax(policy(), -1).gather(1, tokens.T).T  # [B, T]
        mask = MASK.repeat(B)
        loss, metrics = sao_loss.dis_loss(train_lp.reshape(-1), rollout_lp.reshape(-1),
                                          torch.cat(actor_data["advantages"]), mask,
                                          lambda x: (x * mask).sum() / mask.sum(), DIS_PRESETS["maths"])
        policy_opt.zero_grad()
        loss.backward()
        policy_opt.step()
        log["reward"].append(float(reward.mean()))

    for n, p in value_net.named_parameters():
        if n in frozen0:
            assert torch.equal(p, frozen0[n]), f"{n} changed"
            assert p not in critic_opt.state and p.grad is None
    freeze.verify_frozen(value_net, critic_opt, ["self_attention"])
    return log


def test_k_critic_steps_per_policy_step_frozen_attention_and_learning(setup):
    args, modules = setup
    its = 40
    log = run(args, modules, its)
    assert log["critic_steps"] == 2 * its
    assert log["scheduler"].calls == 2 * its and log["scheduler"].num_steps == its * B  # per_rollout schedule
    first, last = log["value_loss"][:6], log["value_loss"][-6:]
    assert sum(last) / 6 < 0.5 * sum(first) / 6, (first, last)
    assert sum(log["reward"][-5:]) / 5 > sum(log["reward"][:5]) / 5 + 0.25, log["reward"]


@pytest.mark.parametrize("k,schedule,steps", [(1, "per_rollout", 1), (3, "per_rollout", 1), (3, "per_pass", 3)])
def test_k_and_lr_schedule(setup, k, schedule, steps):
    args, modules = setup
    args.ascend_sao_critic_iters, args.ascend_sao_critic_lr_schedule = k, schedule
    log = run(args, modules, 3)
    assert log["critic_steps"] == 3 * k
    assert log["scheduler"].num_steps == 3 * B * steps

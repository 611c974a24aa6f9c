"""dis / icepop through real slime's ``policy_loss_function`` on CPU (with and without CP), and
staleness through slime's ``_convert_samples_to_train_data``."""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket

import pytest

from conftest import single_process_megatron
import torch
import zygote

from slime_ascend.algorithms.cp import cp_slice
from slime_ascend.algorithms.masks import DIS_PRESETS, dis_policy_loss
from slime_ascend.offpolicy import staleness as staleness_hook
from slime_ascend.offpolicy.plugin import DIS, ICEPOP, STALENESS

pytestmark = pytest.mark.slime

PLUGINS = {"dis": DIS, "icepop": ICEPOP, "staleness": STALENESS}


@pytest.fixture(autouse=True)
def _clean(fresh_runtime, monkeypatch):
    monkeypatch.delenv("SLIME_ASCEND_PLUGINS", raising=False)
    staleness_hook.reset_state()


def make_args(plugins=(), **overrides):
    values = dict(
        use_rollout_logprobs=False, advantage_estimator="grpo", log_probs_chunk_size=-1, allgather_cp=False,
        rollout_temperature=1.0, entropy_coef=0.0, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None, use_opsm=False,
        get_mismatch_metrics=False, use_tis=False, custom_tis_function_path=None, tis_clip=2.0, tis_clip_low=0.0,
        calculate_per_token_loss=False, use_kl_loss=False, rollout_top_p=1.0, loss_type="policy_loss",
    )
    for name in plugins:
        values.update({s.key: s.default for s in PLUGINS[name].settings})
        values.update(dict(PLUGINS[name].slime_args))
    if plugins:
        values.update(ascend_plugins=list(plugins), custom_tis_function_path="slime_ascend.hooks.tis_function")
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.fixture(scope="module")
def mpu_state():
    with single_process_megatron() as state:
        yield state


def make_batch(seed: int, vocab: int = 13, noise: float = 0.3):
    """Packed logits [1, T, V] and a slime loss batch whose rollout log-probs are near the trainer's."""
    g = torch.Generator().manual_seed(seed)
    rl = [4, 7, 1, 5]
    tl = [r + p for r, p in zip(rl, [3, 2, 6, 4])]
    tokens = [torch.randint(0, vocab, (t,), generator=g) for t in tl]
    logits = torch.randn(1, sum(tl), vocab, generator=g)
    logp = []
    pos = 0
    for tok, t, r in zip(tokens, tl, rl):
        lp = torch.log_softmax(logits[0, pos : pos + t - 1], dim=-1)  # logit j predicts token j + 1
        logp.append(lp[t - 1 - r :].gather(1, tok[t - r :, None]).squeeze(1))
        pos += t
    masks = [(torch.rand(r, generator=g) > 0.15).to(torch.int32) for r in rl]
    batch = {
        "advantages": [torch.randn(r, generator=g) for r in rl],
        "log_probs": [x.clone() for x in logp],  # the recompute at θ_old = θ
        "rollout_log_probs": [x + noise * torch.randn(x.shape, generator=g) for x in logp],
        "unconcat_tokens": tokens, "response_lengths": rl, "total_lengths": tl, "loss_masks": masks,
        "rollout_mask_sums": torch.tensor([float(m.sum()) for m in masks]),
    }
    return logits, batch, logp


def run_policy_loss(args, logits, batch):
    from slime.backends.megatron_utils.cp_utils import get_sum_of_sample_mean
    from slime.backends.megatron_utils.loss import policy_loss_function

    logits = logits.clone().requires_grad_(True)
    reducer = get_sum_of_sample_mean(batch["total_lengths"], batch["response_lengths"], batch["loss_masks"],
                                     batch["rollout_mask_sums"], args.calculate_per_token_loss)
    loss, metrics = policy_loss_function(args, batch, logits, reducer)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("preset", ["glm5", "maths"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dis_through_policy_loss_function_equals_reference(mpu_state, preset, seed):
    logits, batch, logp = make_batch(seed, noise=0.4)
    lo, hi = DIS_PRESETS[preset]
    loss, grad, metrics = run_policy_loss(make_args(["dis"], ascend_dis_preset=preset), logits, batch)

    # reference value: per sample Σ_t keep·w·ppo / rollout_mask_sums, with ppo = -A at θ = θ_old
    ref = 0.0
    for lp, rlp, adv, m, denom in zip(batch["log_probs"], batch["rollout_log_probs"], batch["advantages"],
                                      batch["loss_masks"], batch["rollout_mask_sums"]):
        for t in range(len(lp)):
            w = float(torch.exp(lp[t] - rlp[t]))
            if 1 - lo < w < 1 + hi and m[t]:
                ref += w * -float(adv[t]) / float(denom)
    assert float(loss) == pytest.approx(ref, rel=1e-5, abs=1e-6)

    # reference gradient: the paper's -sg[f(r)]·A·logπθ, each sample's token mean, summed
    ref_logits = logits.clone().requires_grad_(True)
    total, pos = 0.0, 0
    for tok, t, r, rlp, adv, m in zip(batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"],
                                      batch["rollout_log_probs"], batch["advantages"], batch["loss_masks"]):
        lp = torch.log_softmax(ref_logits[0, pos : pos + t - 1], dim=-1)[t - 1 - r :].gather(1, tok[t - r :, None])
        per_tok, _, _ = dis_policy_loss(lp.squeeze(1), rlp, adv, m, lo, hi)
        total = total + (per_tok * m).sum() / m.sum().clamp(min=1)
        pos += t
    (ref_grad,) = torch.autograd.grad(total, ref_logits)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert 0.0 <= float(metrics["dis_masked"]) <= len(logp)
    assert {"dis_k3_kl", "dis_logratio_abs", "dis_ratio"} <= set(metrics)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("beta", [2.0, 5.0])
def test_icepop_through_policy_loss_function_equals_slimes_icepop(mpu_state, seed, beta):
    logits, batch, _ = make_batch(seed, noise=0.6)
    ours = run_policy_loss(make_args(["icepop"], ascend_icepop_beta=beta), logits, batch)
    theirs = run_policy_loss(
        make_args(use_tis=True, custom_tis_function_path="slime.backends.megatron_utils.loss.icepop_function",
                  tis_clip=beta, tis_clip_low=1.0 / beta), logits, batch)
    assert torch.equal(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=0)
    assert float(ours[2]["icepop_ratio"]) == pytest.approx(float(theirs[2]["tis"]), rel=1e-6)


def test_icepop_direct_call_equals_slimes_icepop_function():
    from slime.backends.megatron_utils.loss import icepop_function

    from slime_ascend.offpolicy.tis import CPContext, icepop_apply

    g = torch.Generator().manual_seed(5)
    rl = [3, 9, 4]
    old = [-torch.rand(r, generator=g) * 3 for r in rl]
    rollout = [o + torch.randn(r, generator=g) for o, r in zip(old, rl)]
    pg = torch.randn(sum(rl), generator=g)
    masks = [torch.ones(r, dtype=torch.int32) for r in rl]
    ref_loss, ref_masks, _ = icepop_function(argparse.Namespace(tis_clip=2.0, tis_clip_low=0.5), pg_loss=pg,
                                             train_log_probs=old, rollout_log_probs=rollout, loss_masks=masks)
    loss, new_masks, _ = icepop_apply(pg, old, rollout, masks, [r + 2 for r in rl], rl, beta=2.0, cp=CPContext())
    assert torch.equal(loss, ref_loss) and new_masks == ref_masks


# ---------------------------------------------------------------------------------------------- CP emulation
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fake_entropy(response_lengths):
    """Distinct per-token values: slime reduces entropy with the masks the TIS hook returns, so the
    reported entropy_loss checks those masks under CP."""
    return [torch.arange(r, dtype=torch.float32) * 0.1 + i for i, r in enumerate(response_lengths)]


def _cp_worker(rank, world, port, plugin, out_dir, mask_sums=True):
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SLIME_ASCEND_PLUGINS=plugin)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # slime's cp_utils reads these at call time (as slime's own CP tests stub them)
    mpu.get_context_parallel_world_size = lambda: world
    mpu.get_context_parallel_rank = lambda: rank
    mpu.get_context_parallel_group = lambda: dist.group.WORLD
    try:
        import slime.backends.megatron_utils.loss as loss_mod
        from slime.backends.megatron_utils.cp_utils import get_sum_of_sample_mean

        logits, batch, logp = make_batch(3, noise=0.5)
        if not mask_sums:
            batch["rollout_mask_sums"] = None
        tl, rl = batch["total_lengths"], batch["response_lengths"]
        leaf = torch.cat(logp).clone().requires_grad_(True)  # current log-probs, full; CP slices below

        def local(xs):
            return [cp_slice(x, rank, world, t, r) for x, t, r in zip(xs, tl, rl)]

        local_logp = local(list(leaf.split(rl)))
        entropy = local(fake_entropy(rl))
        loss_mod.get_log_probs_and_entropy = lambda *a, **k: (None, {"log_probs": local_logp, "entropy": entropy})
        for key in ("advantages", "log_probs", "rollout_log_probs"):
            batch[key] = local(batch[key])
        args = make_args([plugin]) if plugin == "dis" else make_args([plugin], ascend_icepop_beta=2.0)
        reducer = get_sum_of_sample_mean(tl, rl, batch["loss_masks"], batch["rollout_mask_sums"], False)
        loss, metrics = loss_mod.policy_loss_function(args, batch, logits, reducer)
        loss.backward()
        grad = leaf.grad.clone()
        dist.all_reduce(grad)  # each rank's gradient lands on its own tokens
        vals = torch.stack([loss.detach()] + [metrics[k] for k in sorted(metrics)])
        dist.all_reduce(vals)  # per-rank partial sums of per-sample means add up to the CP=1 value
        if rank == 0:
            with open(os.path.join(out_dir, "out.json"), "w") as f:
                json.dump({"vals": vals.tolist(), "keys": sorted(metrics), "grad": grad.tolist()}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("plugin", "mask_sums"), [("dis", True), ("dis", False), ("icepop", True)])
def test_cp2_emulation_gives_the_same_loss_metrics_and_gradient(mpu_state, tmp_path, plugin, mask_sums, monkeypatch):
    """Without rollout_mask_sums slime's denominators are the sums of the full masks the hook returns,
    so every CP rank must know the other ranks' DIS decisions."""
    import slime.backends.megatron_utils.loss as loss_mod

    logits, batch, logp = make_batch(3, noise=0.5)
    if not mask_sums:
        batch["rollout_mask_sums"] = None
    leaf = torch.cat(logp).clone().requires_grad_(True)
    pieces = list(leaf.split(batch["response_lengths"]))
    entropy = fake_entropy(batch["response_lengths"])
    monkeypatch.setattr(loss_mod, "get_log_probs_and_entropy", lambda *a, **k: (
        None, {"log_probs": pieces, "entropy": entropy}))
    monkeypatch.setenv("SLIME_ASCEND_PLUGINS", plugin)
    from slime.backends.megatron_utils.cp_utils import get_sum_of_sample_mean

    args = make_args([plugin]) if plugin == "dis" else make_args([plugin], ascend_icepop_beta=2.0)
    reducer = get_sum_of_sample_mean(batch["total_lengths"], batch["response_lengths"], batch["loss_masks"],
                                     batch["rollout_mask_sums"], False)
    loss, metrics = loss_mod.policy_loss_function(args, batch, logits, reducer)
    loss.backward()

    zygote.spawn(_cp_worker, args=(2, _free_port(), plugin, str(tmp_path), mask_sums), nprocs=2)
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["keys"] == sorted(metrics)
    expect = torch.stack([loss.detach()] + [metrics[k] for k in sorted(metrics)])
    torch.testing.assert_close(torch.tensor(got["vals"]), expect, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(got["grad"]), leaf.grad, rtol=1e-5, atol=1e-7)
    if plugin == "dis":
        assert float(metrics["dis_masked"]) > 0  # the band is exercised


# ---------------------------------------------------------------------------------------------- staleness
def test_staleness_removed_samples_get_zero_masks_in_slimes_converter():
    from slime.ray.rollout import RolloutManager as RolloutActor
    from slime.utils.types import Sample

    RolloutManager = getattr(RolloutActor, "__ray_actor_class__", RolloutActor)  # the class behind @ray.remote

    import slime_ascend.hooks as dispatch

    args = make_args(["staleness"], ascend_staleness_tau=1, advantage_estimator="grpo", rewards_normalization=True,
                     grpo_std_normalization=True, n_samples_per_prompt=2, rollout_batch_size=2, reward_key=None,
                     rollout_top_p=1.0)
    samples = []
    for i, (group, version, reward) in enumerate([(0, 5, 1.0), (0, 2, 0.0), (1, 5, 1.0), (1, 4, 0.0)]):
        s = Sample(index=i, group_index=group, tokens=[1, 2, 3, 4, 5], response_length=3, reward=reward,
                   status=Sample.Status.COMPLETED)
        s.weight_versions = [str(version)]
        samples.append(s)
    fake = argparse.Namespace(args=args, custom_convert_samples_to_train_data_func=None,
                              custom_reward_post_process_func=dispatch.reward_post_process)
    fake._post_process_rewards = functools.partial(RolloutManager._post_process_rewards, fake)
    data = RolloutManager._convert_samples_to_train_data(fake, samples)
    # group 0: sample 1 is stale (lag 3) -> padded from sample 0 (1 of 2 valid keeps the group)
    assert [list(m) for m in data["loss_masks"]] == [[1, 1, 1], [0, 0, 0], [1, 1, 1], [1, 1, 1]]
    assert data["rollout_ids"][0] == data["rollout_ids"][1]
    assert data["rollout_mask_sums"][:2] == [3, 3]
    assert staleness_hook.last_staleness_report()["padded"] == 1

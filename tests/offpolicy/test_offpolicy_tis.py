"""dis / icepop (:mod:`slime_ascend.offpolicy.tis`) with slime-shaped inputs (no slime needed)."""

from __future__ import annotations

import json
import math
import os
import types

import pytest
import torch
import zygote
from hypothesis import given, settings
from hypothesis import strategies as st
from plugin_args import plugin_args

from slime_ascend import hooks
from slime_ascend.algorithms.cp import cp_slice
from slime_ascend.algorithms.masks import DIS_PRESETS, dis_policy_loss, token_mean
from slime_ascend.offpolicy.plugin import DIS, ICEPOP
from slime_ascend.offpolicy.tis import CPContext, dis_apply, icepop_apply, validate_dis, validate_icepop
from slime_ascend.plugins.settings import SettingsError

PLUGINS = {p.name: p for p in (DIS, ICEPOP)}


@pytest.fixture(autouse=True)
def _clean(fresh_runtime, monkeypatch):
    monkeypatch.delenv("SLIME_ASCEND_PLUGINS", raising=False)


def make_args(plugins, **overrides):
    return plugin_args([PLUGINS[name] for name in plugins], **overrides)


# ---------------------------------------------------------------------------------------------- data
def batch(seed, n=3, noise=0.4, lengths=None):
    g = torch.Generator().manual_seed(seed)
    rl = lengths or [int(x) for x in torch.randint(1, 9, (n,), generator=g)]
    tl = [r + int(torch.randint(1, 6, (1,), generator=g)) for r in rl]
    old = [-torch.rand(r, generator=g) * 2 for r in rl]
    rollout = [o + noise * torch.randn(r, generator=g) for o, r in zip(old, rl)]
    masks = [(torch.rand(r, generator=g) > 0.2).to(torch.int32) for r in rl]
    pg = torch.randn(sum(rl), generator=g)
    return pg, old, rollout, masks, tl, rl


def ref_dis(pg, old, rollout, masks, eps_low, eps_high, reweight=True):
    """Slow reference: token loop."""
    out, new_masks, masked = [], [], []
    k = 0
    for o, r, m in zip(old, rollout, masks):
        nm = []
        for t in range(len(o)):
            w = math.exp(float(o[t]) - float(r[t]))
            keep = 1 - eps_low < w < 1 + eps_high
            out.append(float(pg[k]) * (w if reweight else 1.0) if keep else 0.0)
            nm.append(int(m[t]) if keep else 0)
            masked.append(0.0 if keep else 1.0)
            k += 1
        new_masks.append(nm)
    return out, new_masks, masked


# ---------------------------------------------------------------------------------------------- DIS
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), preset=st.sampled_from(sorted(DIS_PRESETS)), reweight=st.booleans())
def test_dis_matches_token_loop(seed, preset, reweight):
    pg, old, rollout, masks, tl, rl = batch(seed)
    lo, hi = DIS_PRESETS[preset]
    loss, new_masks, metrics = dis_apply(pg, old, rollout, masks, tl, rl, eps_low=lo, eps_high=hi, reweight=reweight,
                                         cp=CPContext())
    ref_loss, ref_masks, ref_masked = ref_dis(pg, old, rollout, masks, lo, hi, reweight)
    torch.testing.assert_close(loss, torch.tensor(ref_loss), rtol=1e-5, atol=1e-6)
    assert [m.tolist() for m in new_masks] == ref_masks
    assert all(m.dtype == torch.int32 for m in new_masks)
    assert metrics["dis_masked"].tolist() == ref_masked
    for key in ("dis_masked", "dis_ratio", "dis_k3_kl", "dis_logratio_abs", "dis_low", "dis_high"):
        assert metrics[key].shape == pg.shape
    assert torch.equal(metrics["dis_low"] + metrics["dis_high"], metrics["dis_masked"])


def test_dis_band_edges_are_strict():
    # w exactly 1 + eps_high or 1 - eps_low is masked (f(x) = x only for 1-eps_l < x < 1+eps_h)
    old = [torch.tensor([math.log(1.5), math.log(0.5), 0.0], dtype=torch.float64)]
    rollout = [torch.zeros(3, dtype=torch.float64)]
    loss, masks, _ = dis_apply(torch.ones(3, dtype=torch.float64), old, rollout, [torch.ones(3)], [5], [3],
                               eps_low=0.5, eps_high=0.5, cp=CPContext())
    assert loss.tolist() == [0.0, 0.0, 1.0]
    assert masks[0].tolist() == [0.0, 0.0, 1.0]


def ppo_loss(logp, old, adv, eps=0.2, eps_high=0.28):
    ratio = torch.exp(logp - old)
    return torch.maximum(-ratio * adv, -ratio.clamp(1 - eps, 1 + eps_high) * adv)


@pytest.mark.parametrize("seed", range(5))
def test_dis_gradient_equals_paper_dis_at_first_step(seed):
    """At θ = θ_old the DIS-weighted PPO loss has the gradient of -sg[f(r)]·A·logπθ (token mean)."""
    pg, old, rollout, masks, tl, rl = batch(seed, n=4, noise=0.3)
    g = torch.Generator().manual_seed(seed + 100)
    adv = torch.randn(sum(rl), generator=g)
    lo, hi = DIS_PRESETS["glm5"]

    logp = torch.cat(old).clone().requires_grad_(True)
    per_token = ppo_loss(logp, logp.detach(), adv)
    loss, new_masks, _ = dis_apply(per_token, [o.clone() for o in old], rollout, masks, tl, rl,
                                   eps_low=lo, eps_high=hi, cp=CPContext())
    denom = torch.cat(masks).sum()
    ours = (loss * torch.cat(new_masks)).sum() / denom  # slime: modified masks, pre-mask denominator
    (grad_ours,) = torch.autograd.grad(ours, logp)

    logp_ref = torch.cat(old).clone().requires_grad_(True)
    ref_tok, _, _ = dis_policy_loss(logp_ref, torch.cat(rollout), adv, torch.cat(masks), lo, hi)
    (grad_ref,) = torch.autograd.grad(token_mean(ref_tok, torch.cat(masks)), logp_ref)
    torch.testing.assert_close(grad_ours, grad_ref, rtol=1e-5, atol=1e-7)


def test_dis_rejects_bad_shapes_and_missing_rollout_log_probs():
    pg, old, rollout, masks, tl, rl = batch(1)
    with pytest.raises(ValueError, match="CP-local length"):
        dis_apply(pg, old, [r[:-1] for r in rollout], masks, tl, rl, eps_low=0.2, eps_high=0.2, cp=CPContext())
    with pytest.raises(ValueError, match="rollout_log_probs is missing"):
        dis_apply(pg, old, None, masks, tl, rl, eps_low=0.2, eps_high=0.2, cp=CPContext())
    with pytest.raises(ValueError, match="full length"):
        dis_apply(pg, old, rollout, [m[:-1] for m in masks], tl, rl, eps_low=0.2, eps_high=0.2, cp=CPContext())


# ---------------------------------------------------------------------------------------------- IcePop
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), beta=st.sampled_from([1.5, 2.0, 5.0]), reweight=st.booleans())
def test_icepop_matches_token_loop(seed, beta, reweight):
    pg, old, rollout, masks, tl, rl = batch(seed)
    loss, new_masks, metrics = icepop_apply(pg, old, rollout, masks, tl, rl, beta=beta, reweight=reweight,
                                            cp=CPContext())
    ref, k = [], 0
    for o, r in zip(old, rollout):
        for t in range(len(o)):
            rho = math.exp(float(o[t]) - float(r[t]))
            keep = 1 / beta <= rho <= beta
            ref.append(float(pg[k]) * (rho if reweight else 1.0) if keep else 0.0)
            k += 1
    torch.testing.assert_close(loss, torch.tensor(ref), rtol=1e-5, atol=1e-6)
    assert all(a is b for a, b in zip(new_masks, masks))  # IcePop keeps masks (and denominators)
    ref_masked = [0.0 if 1 / beta <= math.exp(float(o) - float(r)) <= beta else 1.0
                  for o, r in zip(torch.cat(old), torch.cat(rollout))]
    assert metrics["icepop_masked"].tolist() == ref_masked
    assert set(metrics) == {"icepop_masked", "icepop_ratio", "icepop_k3_kl", "icepop_logratio_abs"}


# ---------------------------------------------------------------------------------------------- dispatcher
def test_tis_dispatcher_chains_dis_then_icepop(fresh_runtime):
    pg, old, rollout, masks, tl, rl = batch(7, n=5)
    args = make_args(["dis", "icepop"], ascend_dis_weight="mask", ascend_dis_preset="maths")
    loss, new_masks, metrics = hooks.tis_function(args, pg_loss=pg, train_log_probs=old, rollout_log_probs=rollout,
                                                  loss_masks=masks, total_lengths=tl, response_lengths=rl)
    lo, hi = DIS_PRESETS["maths"]
    d_loss, d_masks, _ = dis_apply(pg, old, rollout, masks, tl, rl, eps_low=lo, eps_high=hi, reweight=False,
                                   cp=CPContext())
    i_loss, i_masks, _ = icepop_apply(d_loss, old, rollout, d_masks, tl, rl, beta=2.0, cp=CPContext())
    torch.testing.assert_close(loss, i_loss)
    assert [m.tolist() for m in new_masks] == [m.tolist() for m in d_masks]
    assert {k.split("_")[0] for k in metrics} == {"dis", "icepop"}


def test_validation_errors_name_the_fix(fresh_runtime):
    s = types.SimpleNamespace
    dis_settings = s(preset="maths", eps_low=None, eps_high=None, weight="ratio")
    with pytest.raises(SettingsError, match="--use-tis"):
        validate_dis(make_args(["dis"], use_tis=False), dis_settings)
    with pytest.raises(SettingsError, match="use-rollout-logprobs"):
        validate_dis(make_args(["dis"], use_rollout_logprobs=True), dis_settings)
    with pytest.raises(SettingsError, match="custom_tis_function_path"):
        validate_dis(make_args(["dis"], custom_tis_function_path="x.y"), dis_settings)
    with pytest.raises(SettingsError, match="loss_type"):
        validate_dis(make_args(["dis"], loss_type="custom_loss"), dis_settings)
    with pytest.raises(SettingsError, match="preset: custom"):
        validate_dis(make_args(["dis"]), s(preset="maths", eps_low=0.1, eps_high=None, weight="ratio"))
    with pytest.raises(SettingsError, match="ascend_dis_eps_high"):
        validate_dis(make_args(["dis"]), s(preset="custom", eps_low=0.1, eps_high=None, weight="ratio"))
    with pytest.raises(SettingsError, match="twice"):
        validate_dis(make_args(["dis", "icepop"]), dis_settings)
    validate_dis(make_args(["dis", "icepop"]), s(preset="maths", eps_low=None, eps_high=None, weight="mask"))
    with pytest.raises(SettingsError, match="ascend_icepop_low"):
        validate_icepop(make_args(["icepop"]), s(beta=2.0, low=3.0, reweight=True))


# ---------------------------------------------------------------------------------------------- CP (gloo)
def _cp_worker(rank, world, port, out_dir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        pg, old, rollout, masks, tl, rl = batch(11, lengths=[1, 7, 12, 3])
        tl = [r + p for r, p in zip(rl, [9, 2, 5, 1])]  # prompt-heavy sample: a rank may own no token of it

        def local(xs):
            return [cp_slice(x, rank, world, t, r) for x, t, r in zip(xs, tl, rl)]

        pg_local = torch.cat(local(list(pg.split(rl))))
        loss, new_masks, metrics = dis_apply(pg_local, local(old), local(rollout), masks, tl, rl, eps_low=0.2,
                                             eps_high=0.28, cp=CPContext(rank, world, dist.group.WORLD))
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump({"loss": loss.tolist(), "masks": [m.tolist() for m in new_masks],
                       "masked": metrics["dis_masked"].tolist()}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_dis_under_cp_matches_no_cp(tmp_path, world):
    zygote.spawn(_cp_worker, args=(world, zygote.free_port(), str(tmp_path)), nprocs=world)
    pg, old, rollout, masks, tl, rl = batch(11, lengths=[1, 7, 12, 3])
    tl = [r + p for r, p in zip(rl, [9, 2, 5, 1])]
    loss, new_masks, metrics = dis_apply(pg, old, rollout, masks, tl, rl, eps_low=0.2, eps_high=0.28, cp=CPContext())
    for rank in range(world):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert got["masks"] == [m.tolist() for m in new_masks]  # every rank returns the full masks
        expect = torch.cat([cp_slice(x, rank, world, t, r) for x, t, r in zip(loss.split(rl), tl, rl)])
        torch.testing.assert_close(torch.tensor(got["loss"]), expect)
        expect_m = torch.cat([cp_slice(x, rank, world, t, r)
                              for x, t, r in zip(metrics["dis_masked"].split(rl), tl, rl)])
        assert got["masked"] == expect_m.tolist()

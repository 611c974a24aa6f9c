"""sao's loss pieces: DIS (token-normalised) and clipped value loss, against reference loops."""

from __future__ import annotations

import types

import pytest
import torch

from slime_ascend.algorithms.cp import cp_slice
from slime_ascend.algorithms.masks import DIS_PRESETS, DISBand
from slime_ascend.sao import loss as sao_loss


def token_reducer(mask):
    m = mask.to(torch.float32)
    return lambda x: (x * m).sum() / m.sum().clamp_min(1)


def test_dis_loss_matches_reference_value_and_gradient():
    g = torch.Generator().manual_seed(0)
    n = 64
    theta = torch.randn(n, generator=g, requires_grad=True)
    train_lp = torch.nn.functional.logsigmoid(theta)
    rollout_lp = train_lp.detach() + torch.randn(n, generator=g) * 0.6
    adv = torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) < 0.8).to(torch.int32)
    band = DISBand(0.3, 0.5)
    loss, metrics = sao_loss.dis_loss(train_lp, rollout_lp, adv, mask, token_reducer(mask), band)
    loss.backward()
    got = theta.grad.clone()

    theta.grad = None
    terms, kept, low, high = [], 0, 0, 0
    lp = torch.nn.functional.logsigmoid(theta)
    for t in range(n):
        r = float(torch.exp(lp[t].detach() - rollout_lp[t]))
        if not mask[t]:
            continue
        inside = 1 - band.eps_low < r < 1 + band.eps_high
        low += r <= 1 - band.eps_low
        high += r >= 1 + band.eps_high
        if inside:
            kept += 1
            terms.append(-r * adv[t] * lp[t])
    ref = torch.stack(terms).sum() / int(mask.sum())
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(got, theta.grad)
    trainable = int(mask.sum())
    assert float(metrics["dis_masked_frac"]) == pytest.approx((trainable - kept) / trainable)
    assert float(metrics["dis_low_frac"]) == pytest.approx(low / trainable)
    assert float(metrics["dis_high_frac"]) == pytest.approx(high / trainable)
    assert float(metrics["pg_loss"]) == pytest.approx(float(ref.detach()))


def test_value_loss_is_clipped_like_slime():
    g = torch.Generator().manual_seed(1)
    v = torch.randn(50, generator=g, requires_grad=True)
    old = v.detach() + torch.randn(50, generator=g) * 0.3
    ret = torch.randn(50, generator=g)
    mask = (torch.rand(50, generator=g) < 0.7).to(torch.int32)
    loss, metrics = sao_loss.value_loss(v, old, ret, token_reducer(mask), 0.2)
    ref_terms, clipped = [], 0
    for t in range(50):
        if not mask[t]:
            continue
        vc = old[t] + torch.clamp(v[t] - old[t], -0.2, 0.2)
        ref_terms.append(torch.maximum((vc - ret[t]) ** 2, (v[t] - ret[t]) ** 2))
        clipped += abs(float(v[t] - old[t])) > 0.2
    torch.testing.assert_close(loss, torch.stack(ref_terms).mean())
    assert float(metrics["value_clipfrac"]) == pytest.approx(clipped / len(ref_terms))


def settings_view(**kw):
    base = dict(dis_preset="maths", dis_eps_low=None, dis_eps_high=None)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_dis_band_presets_and_custom():
    assert sao_loss.dis_band(settings_view()) == DIS_PRESETS["maths"]
    assert sao_loss.dis_band(settings_view(dis_preset="coding")) == DISBand(0.8, 3.0)
    assert sao_loss.dis_band(settings_view(dis_preset="custom", dis_eps_low=0.1, dis_eps_high=0.2)) == DISBand(0.1, 0.2)
    with pytest.raises(ValueError, match="custom"):
        sao_loss.dis_band(settings_view(dis_preset="custom", dis_eps_low=0.1))
    with pytest.raises(ValueError, match="set the preset"):
        sao_loss.dis_band(settings_view(dis_eps_high=0.2))


def test_local_loss_masks_follow_cp_layout():
    masks = [torch.arange(7) % 2, torch.ones(5, dtype=torch.int64)]
    totals, resp = [10, 9], [7, 5]
    assert sao_loss.local_loss_masks(masks, totals, resp, 0, 1) == masks
    for r in range(2):
        got = sao_loss.local_loss_masks(masks, totals, resp, r, 2)
        for m, t, n, x in zip(masks, totals, resp, got):
            assert torch.equal(x, cp_slice(m, r, 2, t, n))

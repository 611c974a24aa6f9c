"""Clipped PPO value loss vs a slow reference and vs slime's value_loss_function."""

from __future__ import annotations

from argparse import Namespace

import pytest
import torch

from slime_ascend.algorithms.masks import token_mean
from slime_ascend.algorithms.value_loss import clipped_value_loss


def ref_loss(v, old, ret, c):
    out, frac = [], []
    for x, o, y in zip(v.tolist(), old.tolist(), ret.tolist(), strict=True):
        xc = min(max(x, o - c), o + c)
        out.append(max((xc - y) ** 2, (x - y) ** 2))
        frac.append(1.0 if abs(x - o) > c else 0.0)
    return torch.tensor(out, dtype=torch.float64), torch.tensor(frac, dtype=torch.float64)


@pytest.mark.parametrize("clip", [0.0, 0.2, 10.0])
def test_matches_reference(clip):
    g = torch.Generator().manual_seed(0)
    v, old, ret = (torch.randn(500, dtype=torch.float64, generator=g) for _ in range(3))
    loss, frac = clipped_value_loss(v, old, ret, clip)
    want_l, want_f = ref_loss(v, old, ret, clip)
    torch.testing.assert_close(loss, want_l)
    torch.testing.assert_close(frac, want_f)


def test_clip_chooses_pessimistic_branch_and_gradient():
    old = torch.tensor([0.0, 0.0, 0.0])
    ret = torch.tensor([1.0, 1.0, -1.0])
    v = torch.tensor([0.5, 2.0, 0.5], requires_grad=True)
    loss, frac = clipped_value_loss(v, old, ret, 0.2)
    # token 0: clipped 0.2 -> (0.2-1)^2=0.64 > 0.25 ; token 1: unclipped 1.0 > clipped 0.64 ; token 2: 2.25 > 1.44
    torch.testing.assert_close(loss.detach(), torch.tensor([0.64, 1.0, 2.25]))
    torch.testing.assert_close(frac, torch.tensor([1.0, 1.0, 1.0]))
    loss.sum().backward()
    # the clipped branch is constant in v, so token 0 has no gradient
    torch.testing.assert_close(v.grad, torch.tensor([0.0, 2.0, 3.0]))


def test_bad_input():
    with pytest.raises(ValueError, match="same shape"):
        clipped_value_loss(torch.zeros(3), torch.zeros(3), torch.zeros(4), 0.2)
    with pytest.raises(ValueError, match="value_clip"):
        clipped_value_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), -1.0)


@pytest.mark.slime
def test_matches_slime_value_loss_function(monkeypatch):
    import slime.backends.megatron_utils.loss as loss_mod

    g = torch.Generator().manual_seed(1)
    lens = [5, 9, 3]
    new_vals = [torch.randn(n, generator=g) for n in lens]
    old_vals = [torch.randn(n, generator=g) for n in lens]
    rets = [torch.randn(n, generator=g) for n in lens]
    masks = [(torch.rand(n, generator=g) < 0.7).float() for n in lens]
    monkeypatch.setattr(loss_mod, "get_values", lambda logits, **kw: (None, {"values": new_vals}))

    def sum_of_sample_mean(x):  # slime's cp_size == 1 per-sample mean
        return sum(token_mean(xi, mi) for xi, mi in zip(x.split(lens), masks, strict=True))

    batch = {"values": old_vals, "returns": rets, "unconcat_tokens": None, "total_lengths": None,
             "response_lengths": lens}
    loss, metrics = loss_mod.value_loss_function(Namespace(value_clip=0.2), batch, None, sum_of_sample_mean)

    per_loss, per_frac = clipped_value_loss(torch.cat(new_vals), torch.cat(old_vals), torch.cat(rets), 0.2)
    torch.testing.assert_close(loss, sum_of_sample_mean(per_loss))
    torch.testing.assert_close(metrics["value_clipfrac"], sum_of_sample_mean(per_frac))

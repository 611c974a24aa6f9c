"""DIS and IcePop masks vs per-token reference loops."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend.algorithms.masks import (
    DIS_PRESETS,
    dis_mask,
    dis_policy_loss,
    dis_ratio,
    icepop_weights,
    token_mean,
)


def ref_ratio(a: float, b: float, dtype=torch.float32) -> float:
    return torch.exp(torch.tensor(a, dtype=dtype) - torch.tensor(b, dtype=dtype)).item()


def ref_dis_keep(a: float, b: float, lo: float, hi: float, dtype=torch.float32) -> bool:
    r = ref_ratio(a, b, dtype)
    # bounds rounded to the ratio dtype, as torch compares tensor vs Python scalar in the tensor dtype
    lo_b = torch.tensor(1.0 - lo, dtype=dtype).item()
    hi_b = torch.tensor(1.0 + hi, dtype=dtype).item()
    return lo_b < r < hi_b  # NaN -> False


logps = st.one_of(
    st.floats(-8.0, 0.0, width=32),
    st.sampled_from([0.0, math.log(0.5), math.log(2.0), -1.0, float("nan"), float("-inf")]),
)


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(0, 20),
    data=st.data(),
    preset=st.sampled_from(sorted(DIS_PRESETS)),
)
def test_dis_mask_matches_reference(n: int, data, preset: str) -> None:
    a = data.draw(st.lists(logps, min_size=n, max_size=n))
    b = data.draw(st.lists(logps, min_size=n, max_size=n))
    lo, hi = DIS_PRESETS[preset]
    ta, tb = torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)
    got = dis_mask(ta, tb, lo, hi)
    assert got.dtype == torch.bool
    assert got.tolist() == [ref_dis_keep(x, y, lo, hi) for x, y in zip(a, b)]


def test_dis_band_is_strict_and_icepop_inclusive() -> None:
    # exp(log 0.5) == 0.5 and exp(log 2) == 2 exactly in fp64.
    rollout = torch.zeros(3, dtype=torch.float64)
    train = torch.tensor([math.log(0.5), 0.0, math.log(2.0)], dtype=torch.float64)
    assert dis_ratio(train, rollout).tolist() == [0.5, 1.0, 2.0]
    assert dis_mask(train, rollout, 0.5, 1.0).tolist() == [False, True, False]
    w, keep = icepop_weights(train, rollout, beta=2.0)
    assert keep.tolist() == [True, True, True]
    assert w.tolist() == [0.5, 1.0, 2.0]
    w, keep = icepop_weights(train - 1e-9, rollout, beta=2.0)
    assert keep.tolist() == [False, True, True]


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(0, 16),
    data=st.data(),
    beta=st.sampled_from([1.5, 2.0, 5.0]),
    low=st.sampled_from([None, 0.0, 0.5]),
    reweight=st.booleans(),
)
def test_icepop_matches_reference(n: int, data, beta: float, low, reweight: bool) -> None:
    a = data.draw(st.lists(logps, min_size=n, max_size=n))
    b = data.draw(st.lists(logps, min_size=n, max_size=n))
    w, keep = icepop_weights(torch.tensor(a), torch.tensor(b), beta, low=low, reweight=reweight)
    lo = torch.tensor(1.0 / beta if low is None else low, dtype=torch.float32).item()
    hi = torch.tensor(beta, dtype=torch.float32).item()
    for i, (x, y) in enumerate(zip(a, b)):
        rho = ref_ratio(x, y)
        inside = lo <= rho <= hi
        assert keep[i].item() == inside
        expect = (rho if reweight else 1.0) if inside else 0.0
        assert w[i].item() == pytest.approx(expect, rel=0, abs=0)


def test_icepop_agrees_with_slime_formula() -> None:
    """slime's icepop_function weight: where(low <= exp(old - rollout) <= high, ratio, 0)."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(500, generator=g) * 3
    rollout = old + torch.randn(500, generator=g) * 0.6
    ratio = torch.exp(old - rollout)
    slime_w = torch.where((ratio >= 0.5) & (ratio <= 2.0), ratio, torch.zeros_like(ratio))
    w, _ = icepop_weights(old, rollout, 2.0)
    assert torch.equal(w, slime_w)


def test_dis_policy_loss_value_grad_and_metrics() -> None:
    g = torch.Generator().manual_seed(1)
    n = 64
    rollout = -torch.rand(n, generator=g) * 2
    train = (rollout + torch.randn(n, generator=g) * 0.4).requires_grad_(True)
    adv = torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) > 0.2
    lo, hi = DIS_PRESETS["glm5"]
    loss, keep, m = dis_policy_loss(train, rollout, adv, mask, lo, hi)

    ref_loss, ref_grad, kept, below, above = [], [], [], 0, 0
    lo_b, hi_b = torch.tensor(1.0 - lo).item(), torch.tensor(1.0 + hi).item()  # the band edges in float32
    for i in range(n):
        r = math.exp(train[i].item() - rollout[i].item())
        k = bool(mask[i]) and ref_dis_keep(train[i].item(), rollout[i].item(), lo, hi)
        kept.append(k)
        r32 = ref_ratio(train[i].item(), rollout[i].item())
        below += bool(mask[i]) and r32 <= lo_b
        above += bool(mask[i]) and r32 >= hi_b
        ref_loss.append(-r * adv[i].item() * train[i].item() if k else 0.0)
        ref_grad.append(-r * adv[i].item() if k else 0.0)
    assert keep.tolist() == kept
    assert loss.detach().tolist() == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    total = token_mean(loss, mask)
    assert total.item() == pytest.approx(sum(ref_loss) / int(mask.sum()), rel=1e-5)
    total.backward()
    assert train.grad.tolist() == pytest.approx([x / int(mask.sum()) for x in ref_grad], rel=1e-5, abs=1e-7)
    n_train = int(mask.sum())
    assert int(m["dis_trainable_tokens"]) == n_train
    assert int(m["dis_kept_tokens"]) == sum(kept)
    assert m["dis_masked_frac"].item() == pytest.approx((n_train - sum(kept)) / n_train)
    assert below > 0 and above > 0  # both sides of the band are exercised
    assert m["dis_low_frac"].item() == pytest.approx(below / n_train)
    assert m["dis_high_frac"].item() == pytest.approx(above / n_train)


def test_dis_policy_loss_no_nan_leak_from_masked_tokens() -> None:
    train = torch.tensor([0.0, float("nan"), -1.0], requires_grad=True)
    rollout = torch.tensor([0.0, 0.0, 5.0])  # token 2 far outside the band
    adv = torch.tensor([1.0, 1.0, float("inf")])
    loss, keep, _ = dis_policy_loss(train, rollout, adv, torch.ones(3, dtype=torch.bool), 0.2, 0.28)
    assert keep.tolist() == [True, False, False]
    total = token_mean(loss, torch.ones(3))
    total.backward()
    assert torch.isfinite(total) and torch.isfinite(train.grad).all()


def test_token_mean() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert token_mean(x, torch.tensor([1, 0, 1, 0])).item() == pytest.approx(2.0)
    assert token_mean(x, torch.zeros(4)).item() == 0.0
    with pytest.raises(ValueError, match="must match"):
        token_mean(x, torch.ones(3))


def test_bad_inputs() -> None:
    a = torch.zeros(3)
    with pytest.raises(ValueError, match="same shape"):
        dis_mask(a, torch.zeros(4), 0.2, 0.28)
    with pytest.raises(ValueError, match="eps_low"):
        dis_mask(a, a, 0.0, 0.28)
    with pytest.raises(ValueError, match="eps_high"):
        dis_mask(a, a, 0.2, float("inf"))
    with pytest.raises(TypeError):
        dis_mask(torch.zeros(3, dtype=torch.long), a, 0.2, 0.28)
    with pytest.raises(ValueError, match="beta"):
        icepop_weights(a, a, 1.0)
    with pytest.raises(ValueError, match="low"):
        icepop_weights(a, a, 2.0, low=3.0)
    with pytest.raises(ValueError, match="advantages"):
        dis_policy_loss(a, a, torch.zeros(2), a, 0.2, 0.28)


def test_presets() -> None:
    assert DIS_PRESETS["maths"] == (0.3, 5.0)
    assert DIS_PRESETS["coding"] == (0.8, 3.0)
    assert DIS_PRESETS["glm5"] == (0.2, 0.28)

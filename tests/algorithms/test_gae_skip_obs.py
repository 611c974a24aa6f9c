"""Skip-observation GAE and its discounted reverse scan vs slow reference loops."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend.algorithms.gae import (
    length_adaptive_lambda,
    length_adaptive_lambdas,
    skip_observation_gae,
    terminal_rewards_on_last_action,
    token_gae,
)

# ---------------------------------------------------------------- slow references


def ref_reverse_cumsum(x: list[float], d: float) -> list[float]:
    out, acc = [0.0] * len(x), 0.0
    for t in reversed(range(len(x))):
        acc = x[t] + d * acc
        out[t] = acc
    return out


def ref_skip_obs_gae(v, r, m, gamma, lam):
    """Direct recursion: next time step of an action token is the next action token."""
    v, r, m = v.tolist(), r.tolist(), [int(x != 0) for x in m.tolist()]
    n = len(v)
    adv, ret = [0.0] * n, [0.0] * n
    next_v, next_a = 0.0, 0.0
    for t in reversed(range(n)):
        if not m[t]:
            continue
        delta = r[t] + gamma * next_v - v[t]
        a = delta + gamma * lam * next_a
        adv[t], ret[t] = a, a + v[t]
        next_v, next_a = v[t], a
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


def ref_delete_obs_gae(v, r, m, gamma, lam):
    """Delete observation tokens, run plain token GAE (slime vanilla loop), scatter back."""
    idx = (m != 0).nonzero().squeeze(1)
    vv, rr = v[idx].tolist(), r[idx].tolist()
    a_c, last = [0.0] * len(vv), 0.0
    for t in reversed(range(len(vv))):
        nv = vv[t + 1] if t + 1 < len(vv) else 0.0
        last = rr[t] + gamma * nv - vv[t] + gamma * lam * last
        a_c[t] = last
    adv = torch.zeros(len(v), dtype=torch.float64)
    adv[idx] = torch.tensor(a_c, dtype=torch.float64)
    ret = torch.zeros(len(v), dtype=torch.float64)
    ret[idx] = adv[idx] + v[idx].double()
    return adv, ret


def make_mask(lengths_and_kinds: list[tuple[int, bool]]) -> torch.Tensor:
    return torch.cat([torch.full((n,), int(k)) for n, k in lengths_and_kinds]) if lengths_and_kinds else torch.zeros(0)


spans = st.lists(st.tuples(st.integers(1, 12), st.booleans()), min_size=0, max_size=14)


# ---------------------------------------------------------------- the discounted reverse scan


def scan(rows: list[torch.Tensor], discounts: list[float], chunk_size: int = 128) -> list[torch.Tensor]:
    """The reverse scan y[t] = x[t] + d * y[t+1] of each row, as skip-observation GAE computes it: zero values,
    every token an action, gamma = 1 and lambda = d per sample (so the advantages are the scan of the rewards)."""
    adv, _ = skip_observation_gae([torch.zeros_like(x) for x in rows], rows, [torch.ones_like(x) for x in rows],
                                  1.0, discounts, chunk_size=chunk_size)
    return adv


@pytest.mark.parametrize("T", [1, 2, 7, 128, 129, 1000, 16385])
@pytest.mark.parametrize("d", [0.0, 0.5, 0.97, 1.0])
@pytest.mark.parametrize("chunk", [2, 5, 128])
def test_reverse_cumsum_matches_loop(T, d, chunk):
    x = torch.randn(T, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
    (got,) = scan([x], [d], chunk_size=chunk)
    want = torch.tensor(ref_reverse_cumsum(x.tolist(), d), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-9)


def test_reverse_cumsum_per_row_discount_and_empty():
    x = torch.randn(3, 300, dtype=torch.float64)
    ds = [0.0, 0.9, 1.0]
    got = scan(list(x), ds, chunk_size=16)
    for i, d in enumerate(ds):
        torch.testing.assert_close(got[i], torch.tensor(ref_reverse_cumsum(x[i].tolist(), d), dtype=torch.float64))
    assert [g.shape for g in scan([torch.zeros(0)] * 2, [0.5, 0.5])] == [(0,), (0,)]


def test_reverse_cumsum_long_float32_stable():
    """131072 tokens, discount 1 - 1/(1.5*65536): float32 result stays close to a float64 loop, no inf/nan."""
    T = 131072
    d = 1.0 - 1.0 / (1.5 * 65536)
    x = torch.randn(T, generator=torch.Generator().manual_seed(0))
    (got,) = scan([x], [d])
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    want = torch.tensor(ref_reverse_cumsum(x.double().tolist(), d), dtype=torch.float64)
    err = (got.double() - want).abs().max().item()
    assert err < 2e-3 * want.abs().max().item(), err


def test_reverse_scan_rejects_small_chunk():
    with pytest.raises(ValueError, match="chunk_size"):
        scan([torch.zeros(4)], [0.5], chunk_size=1)


# ---------------------------------------------------------------- skip-observation GAE


@settings(max_examples=80, deadline=None)
@given(
    samples=st.lists(spans, min_size=1, max_size=5),
    gamma=st.sampled_from([0.0, 0.5, 0.99, 1.0]),
    lam=st.floats(0.0, 1.0),
    per_sample=st.booleans(),
    chunk=st.sampled_from([2, 3, 128]),
    seed=st.integers(0, 2**16),
)
def test_skip_obs_matches_both_references(samples, gamma, lam, per_sample, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    masks = [make_mask(s) for s in samples]
    values = [torch.randn(len(m), dtype=torch.float64, generator=g) for m in masks]
    rewards = [torch.randn(len(m), dtype=torch.float64, generator=g) for m in masks]
    lams = [float(torch.rand((), generator=g)) for _ in masks] if per_sample else lam
    adv, ret = skip_observation_gae(values, rewards, masks, gamma, lams, chunk_size=chunk)
    for i, m in enumerate(masks):
        li = lams[i] if per_sample else lam
        a1, r1 = ref_skip_obs_gae(values[i], rewards[i], m, gamma, li)
        a2, r2 = ref_delete_obs_gae(values[i], rewards[i], m, gamma, li)
        torch.testing.assert_close(adv[i], a1, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(ret[i], r1, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(adv[i], a2, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(ret[i], r2, rtol=1e-9, atol=1e-9)
        assert (adv[i][m == 0] == 0).all() and (ret[i][m == 0] == 0).all()


def test_observation_values_and_rewards_are_ignored():
    m = make_mask([(3, True), (4, False), (2, True), (5, False)])
    v = torch.randn(len(m), dtype=torch.float64)
    r = torch.randn(len(m), dtype=torch.float64)
    adv, ret = skip_observation_gae([v], [r], [m], 0.9, 0.8)
    v2, r2 = v.clone(), r.clone()
    v2[m == 0] = 123.0
    r2[m == 0] = -55.0
    adv2, ret2 = skip_observation_gae([v2], [r2], [m], 0.9, 0.8)
    torch.testing.assert_close(adv[0], adv2[0])
    torch.testing.assert_close(ret[0], ret2[0])


def test_differs_from_plain_gae_when_observations_present():
    """Guards against an implementation that ignores the mask."""
    m = make_mask([(3, True), (4, False), (2, True)])
    v = torch.randn(len(m), dtype=torch.float64)
    r = torch.zeros(len(m), dtype=torch.float64)
    r[-1] = 1.0
    adv, _ = skip_observation_gae([v], [r], [m], 0.95, 0.9)
    plain, _ = token_gae([v], [r], 0.95, 0.9)
    assert not torch.allclose(adv[0][m == 1], plain[0][m == 1])


def test_gamma_lambda_one_is_monte_carlo():
    m = make_mask([(5, True), (3, False), (4, True), (6, False), (1, True)])
    v = torch.randn(len(m), dtype=torch.float64)
    r = torch.randn(len(m), dtype=torch.float64)
    adv, ret = skip_observation_gae([v], [r], [m], 1.0, 1.0)
    ra = torch.where(m == 1, r, torch.zeros_like(r))
    togo = torch.flip(torch.cumsum(torch.flip(ra, [0]), 0), [0])
    torch.testing.assert_close(ret[0][m == 1], togo[m == 1])
    torch.testing.assert_close(adv[0][m == 1], (togo - v)[m == 1])


def test_lambda_zero_is_td_error():
    m = make_mask([(2, True), (3, False), (2, True)])
    v = torch.tensor([1.0, 2.0, 9, 9, 9, 3.0, 4.0], dtype=torch.float64)
    r = torch.tensor([0.1, 0.2, 0, 0, 0, 0.3, 0.4], dtype=torch.float64)
    adv, _ = skip_observation_gae([v], [r], [m], 0.5, 0.0)
    want = [0.1 + 0.5 * 2 - 1, 0.2 + 0.5 * 3 - 2, 0, 0, 0, 0.3 + 0.5 * 4 - 3, 0.4 - 4]
    want = torch.tensor(want, dtype=torch.float64)
    torch.testing.assert_close(adv[0], want)


def test_all_observation_single_token_and_empty_samples():
    masks = [torch.zeros(6), torch.ones(1), torch.zeros(0), make_mask([(2, False), (1, True)])]
    values = [torch.randn(len(m)) for m in masks]
    rewards = [torch.randn(len(m)) for m in masks]
    adv, ret = skip_observation_gae(values, rewards, masks, 0.99, 0.95)
    assert [a.shape[0] for a in adv] == [6, 1, 0, 3]
    assert (adv[0] == 0).all() and (ret[0] == 0).all()
    torch.testing.assert_close(adv[1], rewards[1] - values[1])
    torch.testing.assert_close(ret[1], rewards[1])
    torch.testing.assert_close(adv[3][2], rewards[3][2] - values[3][2])
    # every sample all-observation
    adv, ret = skip_observation_gae([torch.randn(3)], [torch.randn(3)], [torch.zeros(3)], 1.0, 1.0)
    assert (adv[0] == 0).all() and (ret[0] == 0).all()
    assert skip_observation_gae([], [], [], 1.0, 1.0) == ([], [])


def test_credit_previous_action_moves_observation_rewards():
    m = make_mask([(1, False), (3, True), (2, False), (2, True), (3, False)])
    v = torch.randn(len(m), dtype=torch.float64)
    r = torch.zeros(len(m), dtype=torch.float64)
    r[0] = 7.0  # before any action: dropped
    r[5] = 0.5  # observation after the first action span -> its last token (index 3)
    r[-1] = 1.0  # terminal reward on the observation tail -> last action token (index 7)
    adv, ret = skip_observation_gae([v], [r], [m], 0.9, 0.7, observation_rewards="credit_previous_action")
    moved = torch.zeros_like(r)
    moved[3], moved[7] = 0.5, 1.0
    want_a, want_r = ref_skip_obs_gae(v, moved, m, 0.9, 0.7)
    torch.testing.assert_close(adv[0], want_a)
    torch.testing.assert_close(ret[0], want_r)
    # default: observation rewards are dropped
    adv_i, _ = skip_observation_gae([v], [r], [m], 0.9, 0.7)
    torch.testing.assert_close(adv_i[0], ref_skip_obs_gae(v, torch.zeros_like(r), m, 0.9, 0.7)[0])


def test_dtype_and_device_preserved():
    m = make_mask([(4, True), (2, False), (3, True)])
    for dt in (torch.float32, torch.bfloat16, torch.float64):
        adv, ret = skip_observation_gae([torch.randn(9).to(dt)], [torch.randn(9)], [m], 1.0, 0.9)
        assert adv[0].dtype == dt and ret[0].dtype == dt


@pytest.mark.slime
def test_matches_slime_chunked_gae_without_observations():
    import slime.utils.ppo_utils as ppo_utils

    g = torch.Generator().manual_seed(3)
    r = torch.randn(4, 1000, generator=g)
    v = torch.randn(4, 1000, generator=g)
    a_s, r_s = ppo_utils.chunked_gae(r, v, 0.99, 0.95)
    a_o, r_o = token_gae(list(v), list(r), 0.99, 0.95)
    torch.testing.assert_close(torch.stack(a_o), a_s, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.stack(r_o), r_s, rtol=1e-4, atol=1e-4)


def test_bad_input_raises():
    m, v, r = torch.ones(3), torch.zeros(3), torch.zeros(3)
    with pytest.raises(ValueError, match="one tensor per sample"):
        skip_observation_gae([v], [r, r], [m], 1.0, 1.0)
    with pytest.raises(ValueError, match="sample 0"):
        skip_observation_gae([v], [torch.zeros(4)], [m], 1.0, 1.0)
    with pytest.raises(ValueError, match="lambd"):
        skip_observation_gae([v], [r], [m], 1.0, 1.2)
    with pytest.raises(ValueError, match="lambd has 2"):
        skip_observation_gae([v], [r], [m], 1.0, [0.5, 0.5])
    with pytest.raises(ValueError, match="gamma"):
        skip_observation_gae([v], [r], [m], -0.1, 1.0)
    with pytest.raises(ValueError, match="observation_rewards"):
        skip_observation_gae([v], [r], [m], 1.0, 1.0, observation_rewards="fold")


# ---------------------------------------------------------------- lambda schedule and reward placement


def test_length_adaptive_lambda():
    assert length_adaptive_lambda(0) == 0.0
    assert math.isclose(length_adaptive_lambda(1), 1 - 1 / 1.5)
    assert math.isclose(length_adaptive_lambda(1000), 1 - 1 / 1500)
    assert length_adaptive_lambda(1, alpha=0.5) == 0.0  # 1 - 2 < 0 -> clamped
    assert length_adaptive_lambda(10**9) < 1.0
    assert length_adaptive_lambdas([make_mask([(2, True), (5, False), (2, True)]), torch.zeros(3)]) == [
        pytest.approx(1 - 1 / 6),
        0.0,
    ]
    with pytest.raises(ValueError, match="alpha"):
        length_adaptive_lambda(10, alpha=0)
    with pytest.raises(ValueError, match="num_trainable_tokens"):
        length_adaptive_lambda(-1)


def test_terminal_rewards_on_last_action():
    masks = [make_mask([(2, True), (3, False)]), torch.zeros(2), torch.ones(3), torch.zeros(0)]
    kl = [torch.full((len(m),), 0.1) for m in masks]
    out = terminal_rewards_on_last_action([1.0, 2.0, 3.0, 4.0], masks, kl)
    torch.testing.assert_close(out[0], torch.tensor([0.1, 1.1, 0.1, 0.1, 0.1]))
    torch.testing.assert_close(out[1], torch.tensor([0.1, 0.1]))
    torch.testing.assert_close(out[2], torch.tensor([0.1, 0.1, 3.1]))
    assert out[3].numel() == 0
    assert kl[0][1].item() == pytest.approx(0.1)  # inputs untouched
    out = terminal_rewards_on_last_action(torch.tensor([5.0]), [masks[0]])
    torch.testing.assert_close(out[0], torch.tensor([0.0, 5.0, 0, 0, 0]))
    with pytest.raises(ValueError, match="scalar_rewards"):
        terminal_rewards_on_last_action([1.0], masks)

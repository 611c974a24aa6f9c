"""CompactionRL cross-segment GAE decay vs slow references."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend.algorithms.gae import (
    apply_segment_decay,
    length_adaptive_lambdas,
    segment_decay_factors,
    skip_observation_gae,
)


def ref_factors(rollout_ids, seg_idx, counts, gamma, lam):
    out = []
    for k in range(len(rollout_ids)):
        n_after = sum(
            counts[j] for j in range(len(rollout_ids)) if rollout_ids[j] == rollout_ids[k] and seg_idx[j] > seg_idx[k]
        )
        out.append((gamma * lam) ** n_after)
    return out


def ref_concat_gae_terminal(n_actions_total: int, gamma: float, lam: float, R: float) -> list[float]:
    """Plain GAE loop with V = 0 over the concatenated trainable tokens, reward R on the very last one."""
    adv, last = [0.0] * n_actions_total, 0.0
    for t in reversed(range(n_actions_total)):
        r = R if t == n_actions_total - 1 else 0.0
        last = r + gamma * lam * last  # V = 0: delta = r
        adv[t] = last
    return adv


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    n_rollouts=st.integers(1, 4),
    gamma=st.sampled_from([0.9, 0.99, 1.0]),
    lam=st.floats(0.0, 1.0),
    seed=st.integers(0, 1000),
)
def test_factors_match_reference_any_order(counts, n_rollouts, gamma, lam, seed):
    rnd = random.Random(seed)
    rollout_ids = [f"r{rnd.randrange(n_rollouts)}" for _ in counts]
    # distinct, non-contiguous segment indices per rollout, entries shuffled
    seg_idx = [0] * len(counts)
    per = {}
    for k, rid in enumerate(rollout_ids):
        per[rid] = per.get(rid, -1) + rnd.randint(1, 3)
        seg_idx[k] = per[rid]
    perm = list(range(len(counts)))
    rnd.shuffle(perm)
    rids = [rollout_ids[p] for p in perm]
    sidx = [seg_idx[p] for p in perm]
    cnts = [counts[p] for p in perm]
    got = segment_decay_factors(rids, sidx, cnts, gamma, lam)
    assert got == pytest.approx(ref_factors(rids, sidx, cnts, gamma, lam), rel=1e-12, abs=1e-300)


def test_factors_simple_and_errors():
    f = segment_decay_factors([7, 7, 7, 8], [0, 1, 2, 0], [10, 20, 5, 3], 1.0, 0.9)
    assert f == pytest.approx([0.9**25, 0.9**5, 1.0, 1.0])
    assert segment_decay_factors([1, 1], [0, 1], [3, 4], 1.0, 0.0) == [0.0, 1.0]
    with pytest.raises(ValueError, match="duplicate segment index"):
        segment_decay_factors([1, 1], [0, 0], [3, 4], 1.0, 0.9)
    with pytest.raises(ValueError, match="one lambda per rollout"):
        segment_decay_factors([1, 1], [0, 1], [3, 4], 1.0, [0.9, 0.8])
    with pytest.raises(ValueError, match="same length"):
        segment_decay_factors([1, 1], [0], [3, 4], 1.0, 0.9)
    with pytest.raises(ValueError, match="trainable_counts"):
        segment_decay_factors([1], [0], [-1], 1.0, 0.9)


def test_length_adaptive_lambdas_one_per_rollout_from_rollout_totals():
    masks = [torch.ones(10), torch.ones(4), torch.ones(20)]
    lams = length_adaptive_lambdas(masks, 1.5, rollout_trainable_tokens=[30, 4, 30])
    assert lams == pytest.approx([1 - 1 / 45, 1 - 1 / 6, 1 - 1 / 45])
    # usable directly as per-entry lambda
    segment_decay_factors(["a", "b", "a"], [0, 0, 1], [10, 4, 20], 1.0, lams)


def _segments(rnd: random.Random, n_seg: int):
    """Segments with interleaved action/observation spans; each has at least one action token."""
    masks = []
    for _ in range(n_seg):
        parts = []
        for _ in range(rnd.randint(1, 5)):
            if rnd.random() < 0.5:
                parts.append(torch.zeros(rnd.randint(1, 6)))
            parts.append(torch.ones(rnd.randint(1, 8)))
        if rnd.random() < 0.5:
            parts.append(torch.zeros(rnd.randint(1, 4)))  # observation tail
        masks.append(torch.cat(parts))
    return masks


def decayed_gae(values, rewards, masks, factors, gamma, lam):
    """Compaction's train side: local skip-observation GAE per segment, then the segment decay."""
    return apply_segment_decay(skip_observation_gae(values, rewards, masks, gamma, lam)[0], factors)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.97), (0.99, 0.9), (1.0, 1.0), (0.95, 0.0)])
def test_identity_with_zero_values_equals_concatenated_trajectory(seed, gamma, lam):
    """V = 0 and R on the last action token of every segment (paper_each_segment): the decayed segment
    advantage equals GAE over the concatenated trainable tokens with R only at the very end."""
    rnd = random.Random(seed)
    R = 1.7
    masks = _segments(rnd, rnd.randint(1, 4))
    order = list(range(len(masks)))
    rnd.shuffle(order)  # segments arrive in any order
    masks_in = [masks[i] for i in order]
    values = [torch.zeros(len(m), dtype=torch.float64) for m in masks_in]
    rewards = []
    for m in masks_in:
        r = torch.zeros(len(m), dtype=torch.float64)
        r[int(m.nonzero().max())] = R
        rewards.append(r)
    counts = [int(m.sum()) for m in masks_in]
    factors = segment_decay_factors(["x"] * len(masks_in), order, counts, gamma, lam)
    adv = decayed_gae(values, rewards, masks_in, factors, gamma, lam)

    want = ref_concat_gae_terminal(sum(counts), gamma, lam, R)
    pos = 0
    got_concat = [None] * sum(counts)
    for seg in range(len(masks)):
        k = order.index(seg)
        a = adv[k][masks_in[k] == 1].tolist()
        got_concat[pos : pos + len(a)] = a
        pos += len(a)
        assert (adv[k][masks_in[k] == 0] == 0).all()
    assert got_concat == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_reward_only_on_final_segment_gives_zero_earlier():
    masks = [torch.ones(3), torch.ones(4)]
    values = [torch.zeros(3), torch.zeros(4)]
    rewards = [torch.zeros(3), torch.tensor([0.0, 0.0, 0.0, 1.0])]
    f = segment_decay_factors([0, 0], [0, 1], [3, 4], 1.0, 0.9)
    adv = decayed_gae(values, rewards, masks, f, 1.0, 0.9)
    assert (adv[0] == 0).all()
    torch.testing.assert_close(adv[1], torch.tensor([0.9**3, 0.9**2, 0.9, 1.0]))


def test_apply_segment_decay_scales_local_advantages():
    local = [torch.tensor([1.0, -2.0, 0.0, 3.0]), torch.tensor([0.0, 0.5, 4.0])]
    factors = [0.25, 1.0]
    for got, a, f in zip(apply_segment_decay(local, factors), local, factors, strict=True):
        assert got.equal(a * f)
    with pytest.raises(ValueError, match="factors"):
        apply_segment_decay(local, [1.0])

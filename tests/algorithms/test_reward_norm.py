"""Group reward normalisation over rollouts, against a hand-written loop (statistics in plain Python)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend.algorithms.reward_norm import group_normalise


def _reference(rewards, groups, rollouts, divide_by_std, eps=1e-6):
    out = []
    for r, g in zip(rewards, groups):
        per_rollout = {ro: rw for rw, gg, ro in zip(rewards, groups, rollouts) if gg == g}
        values = list(per_rollout.values())
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
        out.append((r - mean) / (std + eps) if divide_by_std else r - mean)
    return out


def test_a_group_of_six_by_hand():
    # mean 0.5, unbiased std sqrt(1.5/5) = 0.5477: (1 - 0.5) / 0.5477 = 0.9129
    got = group_normalise([1, 0, 1, 1, 0, 0], ["g"] * 6, range(6), divide_by_std=True)
    assert got == pytest.approx([0.9129, -0.9129, 0.9129, 0.9129, -0.9129, -0.9129], abs=1e-4)


def test_segments_of_one_rollout_count_once():
    # rollout 0 has three segments; the group is {1, 0} over rollouts: mean 0.5
    got = group_normalise([1, 1, 1, 0], ["g"] * 4, [0, 0, 0, 1], divide_by_std=False)
    assert got == [0.5, 0.5, 0.5, -0.5]


def test_a_group_of_one_rollout_is_zero_not_nan():
    """The only valid member left in a group (e.g. kept by the staleness group rule): centred reward 0."""
    got = group_normalise([1.0, 0.0, 1.0], ["a", "b", "b"], [0, 1, 2], divide_by_std=True)
    assert got[0] == 0.0 and all(math.isfinite(v) for v in got)
    assert got[1:] == pytest.approx([-0.7071, 0.7071], abs=1e-4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 4), st.sampled_from([0.0, 0.5, 1.0, 2.0])),
                min_size=1, max_size=12), st.booleans())
def test_matches_the_reference(items, divide_by_std):
    first = {}
    for group, rollout, reward in items:  # one reward per rollout, as the function requires
        first.setdefault((group, rollout), reward)
    groups = [g for g, _, _ in items]
    rollouts = [(g, r) for g, r, _ in items]
    rewards = [first[(g, r)] for g, r, _ in items]
    got = group_normalise(rewards, groups, rollouts, divide_by_std=divide_by_std)
    assert got == pytest.approx(_reference(rewards, groups, rollouts, divide_by_std), rel=1e-5, abs=1e-5)

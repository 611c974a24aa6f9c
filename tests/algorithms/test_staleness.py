"""Staleness and GLM-5 group-failure rule vs a direct reference."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend.algorithms.staleness import (
    SampleStatus,
    filter_groups,
    parse_weight_versions,
    policy_lag,
    staleness_keep,
)


def test_parse_versions() -> None:
    assert parse_weight_versions(["3", "000004", " 7 ", 2, "default"]) == [3, 4, 7, 2, 0]
    for bad in (["v1"], ["-1"], ["1.5"], [True], [None]):
        with pytest.raises(ValueError, match=r"weight_versions\[0\]"):
            parse_weight_versions(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        parse_weight_versions("3")


def test_policy_lag_uses_oldest_version() -> None:
    assert policy_lag(10, ["7", "9", "10"]) == 3
    assert policy_lag(5, ["5"]) == 0
    with pytest.raises(ValueError, match="empty"):
        policy_lag(5, [])
    with pytest.raises(ValueError, match="newer"):
        policy_lag(5, ["6"])


def test_staleness_keep_boundary() -> None:
    assert staleness_keep([0, 2, 3, 4], tau=3) == [True, True, True, False]
    with pytest.raises(ValueError, match="tau"):
        staleness_keep([1], tau=-1)
    with pytest.raises(ValueError, match=r"lags\[1\]"):
        staleness_keep([1, -2], tau=1)


def reference_filter(groups, trainer_version, tau, group_size):
    """Direct restatement of the rule, one sample at a time."""
    out = []
    counts = dict(dropped_stale=0, dropped_env_failed=0, dropped_group=0, dropped_group_samples=0, padded=0)
    for group in groups:
        valid = []
        for s in group:
            if s.env_failed:
                counts["dropped_env_failed"] += 1
                valid.append(False)
            elif tau is not None and trainer_version - min(int(v) for v in s.weight_versions) > tau:
                counts["dropped_stale"] += 1
                valid.append(False)
            else:
                valid.append(True)
        size = group_size or len(group)
        n = sum(valid)
        if n == 0 or n < size / 2:
            counts["dropped_group"] += 1
            counts["dropped_group_samples"] += len(group)
            out.append(None)
        else:
            counts["padded"] += len(group) - n
            out.append(valid)
    return out, counts


status = st.builds(
    SampleStatus,
    weight_versions=st.lists(st.integers(0, 10).map(str), min_size=1, max_size=3),
    env_failed=st.booleans(),
)


@settings(max_examples=100, deadline=None)
@given(
    groups=st.lists(st.lists(status, min_size=1, max_size=6), max_size=6),
    tau=st.one_of(st.none(), st.integers(0, 10)),
    fixed_size=st.booleans(),
)
def test_filter_matches_reference(groups, tau, fixed_size) -> None:
    size = 6 if fixed_size else None
    res = filter_groups(groups, trainer_version=10, tau=tau, group_size=size)
    expect, counts = reference_filter(groups, 10, tau, size)
    assert res.counts() == counts
    for g, (group, valid) in enumerate(zip(groups, expect)):
        if valid is None:
            assert not res.keep_group[g]
            assert res.source[g] == [None] * len(group) and res.train[g] == [False] * len(group)
            continue
        assert res.keep_group[g] and res.train[g] == valid
        for i, src in enumerate(res.source[g]):
            assert src is not None and valid[src]  # always points at a valid member
            if valid[i]:
                assert src == i


def test_padding_round_robin_and_half_rule() -> None:
    ok = SampleStatus(["9"])
    bad = SampleStatus([], env_failed=True)
    stale = SampleStatus(["1"])
    res = filter_groups([[bad, ok, stale, ok], [bad, bad, bad, ok]], trainer_version=10, tau=4)
    assert res.keep_group == [True, False]
    assert res.source[0] == [1, 1, 3, 3]
    assert res.train[0] == [False, True, False, True]
    assert res.counts() == {
        "dropped_stale": 1,
        "dropped_env_failed": 4,
        "dropped_group": 1,
        "dropped_group_samples": 4,
        "padded": 2,
    }
    # short group measured against the configured size: 2 valid of 5 -> dropped
    assert filter_groups([[ok, ok]], 10, None, group_size=5).keep_group == [False]
    assert filter_groups([[ok, ok]], 10, None, group_size=4).keep_group == [True]

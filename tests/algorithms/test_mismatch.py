"""Mismatch statistics vs a per-token reference loop; merge equals union."""

from __future__ import annotations

import bisect
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend.algorithms.mismatch import HIST_EDGES, MismatchSums, mismatch_stats, mismatch_sums


def reference(train, rollout, masks, keeps=None):
    deltas, seq_means, all_masked, rejected = [], [], 0, 0
    for i in range(len(train)):
        ds = []
        for j in range(train[i].numel()):
            if masks[i][j] == 0:
                continue
            all_masked += 1
            if keeps is not None and keeps[i][j] == 0:
                rejected += 1
            d = float(train[i][j]) - float(rollout[i][j])
            if math.isfinite(d):
                ds.append(d)
        deltas += ds
        if ds:
            seq_means.append(sum(abs(x) for x in ds) / len(ds))
    n = len(deltas)
    out = {"tokens": float(n)}
    if n:
        c = [max(-20.0, min(20.0, d)) for d in deltas]
        w = [math.exp(x) for x in c]
        absd = sorted(abs(d) for d in deltas)
        rank = math.ceil(0.99 * n - 1e-9)
        out.update(
            logratio_mean=sum(deltas) / n,
            logratio_abs_mean=sum(abs(d) for d in deltas) / n,
            k3_kl=sum(math.exp(x) - 1 - x for x in c) / n,
            ess=sum(w) ** 2 / (n * sum(x * x for x in w)),
            logratio_abs_p99=absd[rank - 1],
            seq_logratio_abs_mean=sum(seq_means) / len(seq_means),
            nonfinite_frac=(all_masked - n) / all_masked,
        )
    if keeps is not None and all_masked:
        out["masked_frac"] = rejected / all_masked
    return out


def make_batch(seed: int, n_seq: int, nonfinite: bool = False):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 40, (n_seq,), generator=g).tolist()
    train = [-torch.rand(n, generator=g, dtype=torch.float64) * 5 for n in lens]
    rollout = [t + torch.randn(t.shape, generator=g, dtype=torch.float64) * 0.3 for t in train]
    masks = [(torch.rand(n, generator=g) > 0.3).int() for n in lens]
    keeps = [torch.rand(n, generator=g) > 0.1 for n in lens]
    if nonfinite and lens and lens[0] > 1:
        train[0][0] = float("nan")
        rollout[0][1] = float("-inf")
        masks[0][:2] = 1
    return train, rollout, masks, keeps


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n_seq=st.integers(0, 6), nonfinite=st.booleans(), with_keep=st.booleans())
def test_stats_match_reference(seed: int, n_seq: int, nonfinite: bool, with_keep: bool) -> None:
    train, rollout, masks, keeps = make_batch(seed, n_seq, nonfinite)
    keeps = keeps if with_keep else None
    got = mismatch_stats(train, rollout, masks, keeps)
    ref = reference(train, rollout, masks, keeps)
    for key, val in ref.items():
        assert got[key] == pytest.approx(val, rel=1e-9, abs=1e-12), key
    if ref["tokens"] == 0:
        assert math.isnan(got["logratio_mean"]) and math.isnan(got["logratio_abs_p99"])
    else:
        p99 = got["logratio_abs_p99"]
        upper = got["logratio_abs_p99_upper"]
        b = bisect.bisect_right(HIST_EDGES, p99)  # the bin holding p99
        assert upper == (HIST_EDGES[b] if b < len(HIST_EDGES) else math.inf)
        assert p99 <= upper
    assert ("masked_frac" in got) == with_keep
    if with_keep and "masked_frac" not in ref:  # no masked token at all
        assert math.isnan(got["masked_frac"])


def test_token_weighted_not_mean_of_means() -> None:
    train = [torch.zeros(1), torch.zeros(3)]
    rollout = [torch.full((1,), -1.0), torch.full((3,), -3.0)]
    masks = [torch.ones(1), torch.ones(3)]
    s = mismatch_stats(train, rollout, masks)
    assert s["logratio_mean"] == pytest.approx((1 + 9) / 4)
    assert s["seq_logratio_abs_mean"] == pytest.approx((1 + 3) / 2)
    assert s["k3_kl"] > 0


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), split=st.integers(0, 6))
def test_merge_equals_union(seed: int, split: int) -> None:
    train, rollout, masks, keeps = make_batch(seed, 6, nonfinite=True)
    a = mismatch_sums(train[:split], rollout[:split], masks[:split], keeps[:split])
    b = mismatch_sums(train[split:], rollout[split:], masks[split:], keeps[split:])
    whole = mismatch_sums(train, rollout, masks, keeps).finalize()
    merged = MismatchSums.from_tensor(a.to_tensor() + b.to_tensor()).finalize()
    assert merged.keys() == whole.keys()
    for k in whole:
        if math.isnan(whole[k]):
            assert math.isnan(merged[k])
        else:
            assert merged[k] == pytest.approx(whole[k], rel=1e-12), k
    assert a.merge(b).finalize().keys() == whole.keys()


def test_identical_logprobs() -> None:
    t = [torch.tensor([-1.0, -2.0, -0.5])]
    s = mismatch_stats(t, [x.clone() for x in t], [torch.ones(3)])
    assert s["logratio_abs_mean"] == 0 and s["k3_kl"] == 0 and s["ess"] == 1.0
    assert s["logratio_abs_p99"] == 0 and s["logratio_abs_p99_upper"] == HIST_EDGES[0]


def test_bad_inputs() -> None:
    t = [torch.zeros(3)]
    with pytest.raises(ValueError, match="rollout_logp has 2"):
        mismatch_stats(t, [torch.zeros(3)] * 2, [torch.ones(3)])
    with pytest.raises(ValueError, match=r"loss_masks\[0\]"):
        mismatch_stats(t, t, [torch.ones(4)])
    with pytest.raises(TypeError):
        mismatch_stats(torch.zeros(3), t, t)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="length"):
        MismatchSums.from_tensor(torch.zeros(5))

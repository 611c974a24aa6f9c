"""Deterministic (values, indices) top-k, the key-sharded merge rule and index-set agreement vs slow references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend.algorithms.dsa_topk import (
    deterministic_topk,
    index_set_agreement,
    local_topk_candidates,
    merge_topk_candidates,
    sharded_deterministic_topk,
    topk_jaccard,
)
from slime_ascend.algorithms.topk import deterministic_topk_indices

NEG_INF = float("-inf")


def reference_topk(rows: list[list[float]], k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Obviously right: per row, sort (value, index) by value desc then index asc, drop -inf, keep k, pad."""
    out_v, out_i = [], []
    for row in rows:
        if any(math.isnan(x) for x in row):
            raise ValueError("NaN")
        order = sorted((i for i in range(len(row)) if row[i] != NEG_INF), key=lambda i: (-row[i], i))[:k]
        out_v.append([row[i] for i in order] + [NEG_INF] * (k - len(order)))
        out_i.append(order + [-1] * (k - len(order)))
    return out_v, out_i


def reference_sharded(rows: list[list[float]], k: int, sizes: list[int]) -> tuple[list[list[float]], list[list[int]]]:
    """Slow merge: per shard the reference top-k with global indices, then the reference over the candidates."""
    out_v, out_i = [], []
    for row in rows:
        cands: list[tuple[float, int]] = []
        off = 0
        for size in sizes:
            shard = row[off: off + size]
            v, i = reference_topk([shard], k)
            cands += [(x, j + off) for x, j in zip(v[0], i[0]) if j >= 0]
            off += size
        cands.sort(key=lambda c: (-c[0], c[1]))
        cands = cands[:k]
        out_v.append([c[0] for c in cands] + [NEG_INF] * (k - len(cands)))
        out_i.append([c[1] for c in cands] + [-1] * (k - len(cands)))
    return out_v, out_i


# Few distinct values: ties everywhere; ±0.0, +inf and -inf are the edge cases.
VALUES = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, float("inf"), NEG_INF])


def _same(got: tuple[torch.Tensor, torch.Tensor], ref: tuple[list, list], dtype=torch.float32) -> None:
    values, indices = got
    rv, ri = ref
    assert indices.tolist() == ri
    # values compared as numbers (-0.0 == 0.0 is the rule), and the exact stored values of the keys
    assert values.tolist() == rv


@st.composite
def sharded_rows(draw):
    n_rows = draw(st.integers(0, 3))
    sizes = draw(st.lists(st.integers(0, 7), min_size=1, max_size=5))
    length = sum(sizes)
    flat = draw(st.lists(VALUES, min_size=n_rows * length, max_size=n_rows * length))
    k = draw(st.integers(0, length + 4))
    return [flat[r * length:(r + 1) * length] for r in range(n_rows)], sizes, length, k


@settings(max_examples=150, deadline=None)
@given(case=sharded_rows())
def test_values_and_indices_match_reference(case) -> None:
    rows, _, length, k = case
    scores = torch.tensor(rows, dtype=torch.float32).reshape(len(rows), length)
    got = deterministic_topk(scores, k)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.int64
    assert got[0].shape == got[1].shape == (len(rows), k)
    _same(got, reference_topk(rows, k))
    # the same selected set as the package's ascending-index top-k
    asc = deterministic_topk_indices(scores, k)
    assert torch.equal(torch.sort(torch.where(got[1] < 0, length, got[1]), -1).values,
                       torch.where(asc < 0, length, asc))


@settings(max_examples=200, deadline=None)
@given(case=sharded_rows())
def test_sharded_merge_equals_unsharded_and_reference(case) -> None:
    """The merge rule: uneven (and empty) shards, ties across shard borders, ±inf, k above the valid count."""
    rows, sizes, length, k = case
    scores = torch.tensor(rows, dtype=torch.float32).reshape(len(rows), length)
    merged = sharded_deterministic_topk(scores, k, sizes)
    whole = deterministic_topk(scores, k)
    assert torch.equal(merged[1], whole[1])
    assert torch.equal(merged[0], whole[0])
    assert torch.equal(torch.signbit(merged[0]), torch.signbit(whole[0]))  # the key's own value, -0.0 kept
    _same(merged, reference_sharded(rows, k, sizes))
    _same(merged, reference_topk(rows, k))


@settings(max_examples=50, deadline=None)
@given(length=st.integers(1, 400), k=st.integers(1, 80), n_shards=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_sharded_merge_random_integers(length: int, k: int, n_shards: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-4, 4, (3, length), generator=g).float()  # heavy ties
    scores[0, ::3] = NEG_INF
    cuts = sorted(torch.randint(0, length + 1, (n_shards - 1,), generator=g).tolist())
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [length])]
    merged = sharded_deterministic_topk(scores, k, sizes, index_dtype=torch.int32)
    assert merged[1].dtype == torch.int32
    whole = deterministic_topk(scores, k, index_dtype=torch.int32)
    assert torch.equal(merged[0], whole[0]) and torch.equal(merged[1], whole[1])
    _same(whole, reference_topk(scores.tolist(), k))


def test_shard_order_and_batch_dims_do_not_matter() -> None:
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 3, (2, 3, 50), generator=g).to(torch.bfloat16)
    parts = [(0, 17), (17, 20), (20, 50)]
    cands = [local_topk_candidates(scores[..., a:b], 8, a) for a, b in parts]
    forward = merge_topk_candidates([c[0] for c in cands], [c[1] for c in cands], 8)
    backward = merge_topk_candidates([c[0] for c in cands[::-1]], [c[1] for c in cands[::-1]], 8)
    whole = deterministic_topk(scores, 8)
    for got in (forward, backward):
        assert got[0].dtype == torch.bfloat16 and got[0].shape == (2, 3, 8)
        assert torch.equal(got[0], whole[0]) and torch.equal(got[1], whole[1])


def test_nan_is_rejected_in_every_path() -> None:
    scores = torch.tensor([[1.0, float("nan"), 0.0, 2.0]])
    with pytest.raises(ValueError, match="NaN"):
        deterministic_topk(scores, 2)
    with pytest.raises(ValueError, match="NaN"):
        sharded_deterministic_topk(scores, 2, [2, 2])
    with pytest.raises(ValueError, match="NaN"):
        merge_topk_candidates([torch.tensor([[float("nan")]])], [torch.tensor([[0]])], 1)


def test_merge_refuses_overlapping_shards_and_bad_arguments() -> None:
    v = torch.tensor([[2.0, 1.0]])
    i = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="overlap"):
        merge_topk_candidates([v, v], [i, i], 2)
    with pytest.raises(ValueError, match="sum to L"):
        sharded_deterministic_topk(torch.zeros(1, 4), 2, [1, 2])
    with pytest.raises(TypeError, match="floating"):
        deterministic_topk(torch.zeros(1, 4, dtype=torch.long), 2)
    with pytest.raises(TypeError, match="index_dtype"):
        deterministic_topk(torch.zeros(1, 4), 2, index_dtype=torch.int16)
    with pytest.raises(ValueError, match="offset"):
        local_topk_candidates(torch.zeros(1, 4), 2, -1)
    # a padding candidate (-1, or a -inf value) never comes back, whatever its partner says
    got = merge_topk_candidates(torch.tensor([[NEG_INF, 3.0, 1.0]]), torch.tensor([[5, -1, 7]]), 3)
    assert got[1].tolist() == [[7, -1, -1]] and got[0].tolist() == [[1.0, NEG_INF, NEG_INF]]


def test_negative_zero_ties_with_positive_zero_by_index() -> None:
    scores = torch.tensor([[0.0, -0.0, 0.0, -0.0]])
    values, idx = sharded_deterministic_topk(scores, 3, [1, 3])
    assert idx.tolist() == [[0, 1, 2]]
    assert torch.signbit(values).tolist() == [[False, True, False]]


def jaccard_reference(a: list[int], b: list[int]) -> float:
    sa, sb = {x for x in a if x >= 0}, {x for x in b if x >= 0}
    return 1.0 if not (sa | sb) else len(sa & sb) / len(sa | sb)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), rows=st.integers(0, 4), ka=st.integers(0, 6), kb=st.integers(0, 6))
def test_jaccard_matches_reference(data, rows: int, ka: int, kb: int) -> None:
    def row(k):
        chosen = data.draw(st.lists(st.integers(0, 9), unique=True, max_size=k))
        perm = data.draw(st.permutations(chosen + [-1] * (k - len(chosen))))
        return list(perm)

    a = [row(ka) for _ in range(rows)]
    b = [row(kb) for _ in range(rows)]
    got = topk_jaccard(torch.tensor(a, dtype=torch.long).reshape(rows, ka),
                       torch.tensor(b, dtype=torch.int32).reshape(rows, kb))
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx([jaccard_reference(x, y) for x, y in zip(a, b)])


def test_index_set_agreement() -> None:
    a = torch.tensor([[0, 1, 2, -1], [3, 4, -1, -1], [-1, -1, -1, -1]])
    b = torch.tensor([[2, 1, 0, -1], [3, 5, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    got = index_set_agreement(a, b)
    assert got["rows"] == 3
    assert got["rows_identical_frac"] == pytest.approx(2 / 3)
    assert got["jaccard_mean"] == pytest.approx((1 + 1 / 3 + 1) / 3)
    assert got["jaccard_min"] == pytest.approx(1 / 3)
    assert index_set_agreement(a[:0], b[:0])["rows_identical_frac"] == 1.0

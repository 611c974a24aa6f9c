"""Deterministic top-k vs a slow reference; replay validation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend.algorithms.topk import deterministic_topk_indices, replay_topk_indices


def reference_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Obviously-right loop: sort keys by (score desc, index asc), keep k, drop -inf, emit ascending."""
    shape = scores.shape
    rows = scores.reshape(-1, shape[-1]).tolist() if shape[-1] > 0 else [[] for _ in range(int(math.prod(shape[:-1])))]
    out = []
    for row in rows:
        order = sorted(range(len(row)), key=lambda i: (-row[i], i))
        chosen = sorted(i for i in order[:k] if row[i] != float("-inf"))
        out.append(chosen + [-1] * (k - len(chosen)))
    return torch.tensor(out, dtype=torch.long).reshape(*shape[:-1], k)


# Small value alphabet forces ties everywhere; -inf/inf/±0.0 exercise the edge cases.
values = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf")])


@settings(max_examples=100, deadline=None)
@given(
    rows=st.integers(0, 4),
    length=st.integers(0, 12),
    k=st.integers(0, 15),
    data=st.data(),
)
def test_matches_reference_with_ties(rows: int, length: int, k: int, data) -> None:
    flat = data.draw(st.lists(values, min_size=rows * length, max_size=rows * length))
    scores = torch.tensor(flat, dtype=torch.float32).reshape(rows, length)
    got = deterministic_topk_indices(scores, k)
    assert got.dtype == torch.long and got.shape == (rows, k)
    assert torch.equal(got, reference_topk(scores, k))


@settings(max_examples=50, deadline=None)
@given(length=st.integers(1, 300), k=st.integers(1, 64), seed=st.integers(0, 2**16))
def test_random_scores_match_reference_and_torch_set(length: int, k: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-5, 5, (3, length), generator=g).float()  # many ties
    got = deterministic_topk_indices(scores, k)
    assert torch.equal(got, reference_topk(scores, k))


def test_unique_scores_equal_sorted_torch_topk() -> None:
    scores = torch.randn(2, 3, 500, generator=torch.Generator().manual_seed(0))
    got = deterministic_topk_indices(scores, 37)
    expect = torch.topk(scores, 37).indices.sort(-1).values
    assert torch.equal(got, expect)


def test_ties_pick_lowest_index() -> None:
    scores = torch.tensor([[1.0, 3.0, 1.0, 1.0, 3.0, 1.0]])
    assert deterministic_topk_indices(scores, 3).tolist() == [[0, 1, 4]]
    assert deterministic_topk_indices(scores, 4).tolist() == [[0, 1, 2, 4]]


def test_neg_inf_and_padding() -> None:
    scores = torch.tensor([[float("-inf"), 2.0, float("-inf"), 1.0]])
    assert deterministic_topk_indices(scores, 3).tolist() == [[1, 3, -1]]
    assert deterministic_topk_indices(scores, 6).tolist() == [[1, 3, -1, -1, -1, -1]]


def test_empty_rows_and_k_zero() -> None:
    assert deterministic_topk_indices(torch.empty(2, 0), 3).tolist() == [[-1, -1, -1]] * 2
    assert deterministic_topk_indices(torch.randn(2, 5), 0).shape == (2, 0)
    assert deterministic_topk_indices(torch.randn(0, 5), 2).shape == (0, 2)
    assert deterministic_topk_indices(torch.randn(7), 2).shape == (2,)


def test_nan_rejected() -> None:
    with pytest.raises(ValueError, match="NaN"):
        deterministic_topk_indices(torch.tensor([[1.0, float("nan")]]), 1)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        deterministic_topk_indices(torch.tensor(1.0), 1)
    with pytest.raises(ValueError):
        deterministic_topk_indices(torch.randn(3), -1)
    with pytest.raises(TypeError):
        deterministic_topk_indices(torch.randn(3), 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        deterministic_topk_indices(torch.ones(3, dtype=torch.bool), 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.int32])
def test_dtypes(dtype: torch.dtype) -> None:
    scores = torch.randint(-3, 3, (4, 50), generator=torch.Generator().manual_seed(1)).to(dtype)
    assert torch.equal(deterministic_topk_indices(scores, 9), reference_topk(scores.double(), 9))


def test_independent_of_thread_count_and_repeat() -> None:
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 4, (8, 20000), generator=g).float()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = deterministic_topk_indices(scores, 512)
        torch.set_num_threads(max(2, before))
        many = [deterministic_topk_indices(scores, 512) for _ in range(3)]
    finally:
        torch.set_num_threads(before)
    for m in many:
        assert torch.equal(one, m)
    assert torch.equal(one, reference_topk(scores, 512))


def test_replay_roundtrip_and_validation() -> None:
    scores = torch.tensor([[float("-inf"), 2.0, 0.5, 1.0]])
    idx = deterministic_topk_indices(scores, 3)
    assert torch.equal(replay_topk_indices(idx, 3, 4), idx)
    assert replay_topk_indices(torch.tensor([[3, -1, 1]]), 3, 4, canonicalize=True).tolist() == [[1, 3, -1]]
    with pytest.raises(ValueError, match="canonical"):
        replay_topk_indices(torch.tensor([[3, -1, 1]]), 3, 4)
    with pytest.raises(ValueError, match="duplicate"):
        replay_topk_indices(torch.tensor([[1, 1, -1]]), 3, 4)
    with pytest.raises(ValueError, match="range"):
        replay_topk_indices(torch.tensor([[1, 4, -1]]), 3, 4)
    with pytest.raises(ValueError, match="range"):
        replay_topk_indices(torch.tensor([[-2, 1, 2]]), 3, 4)
    with pytest.raises(ValueError, match="shape"):
        replay_topk_indices(torch.tensor([[1, 2]]), 3, 4)
    with pytest.raises(ValueError, match="batch shape"):
        replay_topk_indices(torch.tensor([[1, 2, 3]]), 3, 4, batch_shape=(2,))
    with pytest.raises(TypeError):
        replay_topk_indices(torch.tensor([[1.0, 2.0, 3.0]]), 3, 4)


def test_non_contiguous_batched_input() -> None:
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, 3, (2, 40, 3), generator=g).float()
    scores = base.transpose(1, 2)  # [2, 3, 40], non-contiguous
    assert not scores.is_contiguous()
    assert torch.equal(deterministic_topk_indices(scores, 7), reference_topk(scores.contiguous(), 7))

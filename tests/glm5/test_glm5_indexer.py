"""The torch lightning indexer (scores, dsa-determinism top-k, backward) vs loop references and gradcheck."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend.glm5.ops import _blocks
from slime_ascend.glm5.ops.indexer import (
    IndexerFunction,
    generate_varlen_mask_params,
    indexer_bwd_interface,
    indexer_fwd_interface,
    lighting_indexer,
)

NEG_INF = float("-inf")


def loop_logits(q, k, w, ks, ke):
    """Obviously right: every (query, key) pair by hand, -inf outside [ks, ke)."""
    t, h, _ = q.shape
    out = [[NEG_INF] * k.shape[0] for _ in range(t)]
    for i in range(t):
        for j in range(int(ks[i]), min(int(ke[i]), k.shape[0])):
            out[i][j] = sum(max(float(q[i, hh] @ k[j]), 0.0) * float(w[i, hh]) for hh in range(h))
    return torch.tensor(out, dtype=torch.float64)


def brute_topk(row: list[float], k: int) -> list[int]:
    """Keys sorted by (score desc, index asc), -inf dropped, padded with -1 to width k."""
    order = sorted((j for j, x in enumerate(row) if x != NEG_INF), key=lambda j: (-row[j], j))[:k]
    return order + [-1] * (k - len(order))


def varlen(lengths: list[int]):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    starts, ends = generate_varlen_mask_params(cu)
    return cu, starts.int(), ends.int()


def inputs(t, h, d, dtype=torch.float64, seed=0, integer=False):
    g = torch.Generator().manual_seed(seed)
    if integer:  # small integers: many exactly tied scores
        mk = lambda *s: torch.randint(-2, 3, s, generator=g).to(dtype)  # noqa: E731
    else:
        mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return mk(t, h, d), mk(t, d), mk(t, h).abs() + (0 if integer else 0.1)


def test_varlen_mask_params_are_causal_per_segment():
    _, starts, ends = varlen([3, 1, 4])
    assert starts.tolist() == [0, 0, 0, 3, 4, 4, 4, 4]
    assert ends.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]


def test_varlen_mask_params_refuse_a_bad_cu_seqlens():
    with pytest.raises(ValueError, match="cu_seqlens"):
        generate_varlen_mask_params(torch.tensor([1, 3]))


@pytest.mark.parametrize("blocks", [None, 1])
def test_forward_matches_loop_reference_varlen(monkeypatch, blocks):
    if blocks:
        monkeypatch.setattr(_blocks, "MAX_BLOCK_ELEMENTS", blocks)  # one query per block
    _, ks, ke = varlen([5, 1, 3, 7])
    q, k, w = inputs(16, 3, 4)
    got = indexer_fwd_interface(q, k, w, ks, ke)
    assert got.dtype == torch.float64 and got.shape == (16, 16)
    ref = loop_logits(q, k, w, ks, ke)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    finite = torch.isfinite(ref)
    assert (got[finite] - ref[finite]).abs().max() < 1e-12


def test_forward_without_cleaning_keeps_every_scored_key():
    _, ks, ke = varlen([4, 4])
    q, k, w = inputs(8, 2, 4, seed=1)
    raw = indexer_fwd_interface(q, k, w, ks, ke, clean_logits=False)
    ref = loop_logits(q, k, w, ks, ke)
    finite = torch.isfinite(ref)
    assert (raw[finite] - ref[finite]).abs().max() < 1e-12


def test_forward_clamps_key_ranges_and_accepts_one_key_head():
    q, k, w = inputs(3, 2, 4, seed=2)
    ks, ke = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([9, 1, 7], dtype=torch.int32)
    got = indexer_fwd_interface(q, k[:, None, :], w[..., None], ks, ke)
    ref = loop_logits(q, k, w, ks.clamp(max=3), ke.clamp(max=3))
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert torch.isinf(got[1:]).all()  # ks >= ke and ks beyond T_kv select nothing


def test_bf16_inputs_give_float32_logits_close_to_reference():
    _, ks, ke = varlen([6, 6])
    q, k, w = inputs(12, 4, 16, seed=3)
    got = indexer_fwd_interface(q.bfloat16(), k.bfloat16(), w.float(), ks, ke)
    assert got.dtype == torch.float32
    ref = loop_logits(q.bfloat16().double(), k.bfloat16().double(), w.float().double(), ks, ke)
    finite = torch.isfinite(ref)
    assert (got.double()[finite] - ref[finite]).abs().max() < 1e-4


def test_shape_errors_are_one_line_and_name_the_field():
    q, k, w = inputs(4, 2, 4)
    with pytest.raises(ValueError, match="^weights has shape") as err:
        indexer_fwd_interface(q, k, w[:3], torch.zeros(4, dtype=torch.int32), torch.ones(4, dtype=torch.int32))
    assert "\n" not in str(err.value)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 7), min_size=1, max_size=4), topk=st.integers(1, 6), seed=st.integers(0, 99))
def test_lighting_indexer_selects_by_the_tie_rule_with_minus_one_padding(lengths, topk, seed):
    _, ks, ke = varlen(lengths)
    t = sum(lengths)
    q, k, w = inputs(t, 2, 3, seed=seed, integer=True)
    scores, idx = lighting_indexer(q, k, w[..., None], ks, ke, topk)
    assert idx.dtype == torch.int32 and idx.shape == (t, topk) and scores.shape == (t, topk)
    ref = loop_logits(q, k, w, ks, ke)
    for i in range(t):
        row = ref[i].tolist()
        want = brute_topk(row, topk)
        assert idx[i].tolist() == want
        assert scores[i].tolist() == [row[j] if j >= 0 else NEG_INF for j in want]
        # a query sees only its own segment's past: fewer valid keys than topk are padded with -1
        n_valid = int(ke[i] - ks[i])
        assert (idx[i] >= 0).sum() <= min(n_valid, topk)


def test_lighting_indexer_refuses_nan_scores():
    _, ks, ke = varlen([3])
    q, k, w = inputs(3, 2, 4)
    q[1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        lighting_indexer(q, k, w, ks, ke, 2)


def test_given_topk_indices_are_reused():
    _, ks, ke = varlen([4])
    q, k, w = inputs(4, 2, 4)
    given_idx = torch.tensor([[0, -1], [0, 1], [2, -1], [3, 0]], dtype=torch.int32)
    scores, idx = lighting_indexer(q, k, w, ks, ke, 2, given_idx)
    ref = loop_logits(q, k, w, ks, ke)
    assert torch.equal(idx, given_idx)
    want = [[ref[i, j].item() if j >= 0 else NEG_INF for j in row] for i, row in enumerate(given_idx.tolist())]
    assert torch.allclose(scores, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)


def dense_gathered_scores(q, k, w, idx):
    """Autograd reference: all logits densely (no masking needed for the gathered valid slots), gathered."""
    dense = torch.einsum("thd,nd->thn", q, k).clamp(min=0).mul(w[..., None]).sum(1)
    valid = idx >= 0
    return torch.where(valid, dense.gather(1, idx.clamp(min=0).long()), torch.zeros((), dtype=q.dtype))


@pytest.mark.parametrize("blocks", [None, 3])
def test_backward_matches_autograd_of_a_dense_reference(monkeypatch, blocks):
    if blocks:
        monkeypatch.setattr(_blocks, "MAX_BLOCK_ELEMENTS", blocks)
    _, ks, ke = varlen([5, 2, 6])
    q, k, w = inputs(13, 3, 4, seed=5)
    _, idx = lighting_indexer(q, k, w, ks, ke, 4)
    g = torch.randn(13, 4, dtype=torch.float64)
    g_nan = g.masked_fill(idx < 0, float("nan"))  # padding slots' gradients must not leak
    gq, gw, gk = indexer_bwd_interface(q, w, k, idx, g_nan)
    qr, kr, wr = (x.clone().requires_grad_() for x in (q, k, w))
    (dense_gathered_scores(qr, kr, wr, idx) * g.masked_fill(idx < 0, 0)).sum().backward()
    for got, ref in ((gq, qr.grad), (gw, wr.grad), (gk, kr.grad)):
        assert got.shape == ref.shape and (got - ref).abs().max() < 1e-12


def test_backward_dtypes_and_shapes_follow_the_kernel():
    _, ks, ke = varlen([4, 4])
    q, k, w = inputs(8, 2, 8, seed=6)
    q, k, w = q.bfloat16(), k.bfloat16(), w.float()[..., None]
    _, idx = lighting_indexer(q, k, w, ks, ke, 4)
    gq, gw, gk = indexer_bwd_interface(q, w, k, idx, torch.ones(8, 4))
    assert (gq.dtype, gw.dtype, gk.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    assert (gq.shape, gw.shape, gk.shape) == (q.shape, w.shape, k.shape)


def test_indexer_function_gradcheck_float64():
    _, ks, ke = varlen([3, 4])
    q, k, w = inputs(7, 2, 3, seed=7)
    _, idx = lighting_indexer(q, k, w, ks, ke, 3)
    args = [x.clone().requires_grad_() for x in (q, k, w)]

    def scores(q, k, w):  # the selection is fixed: the scores are smooth away from relu's kink
        return IndexerFunction.apply(q, k, w, ks, ke, 3, idx)[0].masked_fill(idx < 0, 0.0)

    assert torch.autograd.gradcheck(scores, args)

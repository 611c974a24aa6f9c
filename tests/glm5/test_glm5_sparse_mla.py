"""Sparse MLA (gathered keys per query) vs dense attention masked to the selected keys, and gradcheck."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend.glm5.ops import _blocks
from slime_ascend.glm5.ops.indexer import generate_varlen_mask_params, lighting_indexer
from slime_ascend.glm5.ops.sparse_mla import SparseMLA, sparse_mla_bwd, sparse_mla_fwd_interface


def dense_reference(q, kv, indices, scale, d_v):
    """Obviously right: full attention over every key, masked to each query's selected set (per group)."""
    t, h, _ = q.shape
    t_kv, g, _ = kv.shape
    allowed = torch.zeros(t, g, t_kv, dtype=torch.bool)
    for i in range(t):
        for gg in range(g):
            for j in indices[i, gg].tolist():
                if 0 <= j < t_kv:
                    allowed[i, gg, j] = True
    head_group = torch.arange(h) // (h // g)
    keys = kv[:, head_group, :]  # [T_kv, H, dim]
    scores = torch.einsum("thd,nhd->thn", q, keys) * scale
    scores = scores.masked_fill(~allowed[:, head_group, :], float("-inf"))
    lse = torch.logsumexp(scores, -1) / math.log(2.0)
    out = torch.einsum("thn,nhd->thd", torch.softmax(scores, -1), keys[..., :d_v])
    return out, lse


def random_case(t, t_kv, h, g, dim, topk, seed, pad_frac=0.3):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, dim, generator=gen, dtype=torch.float64)
    kv = torch.randn(t_kv, g, dim, generator=gen, dtype=torch.float64)
    idx = torch.stack([torch.stack([torch.randperm(t_kv, generator=gen)[:topk] for _ in range(g)]) for _ in range(t)])
    pad = torch.rand(t, g, topk, generator=gen) < pad_frac
    pad[..., 0] = False  # every query keeps at least one key
    return q, kv, idx.masked_fill(pad, -1).int()


@pytest.mark.parametrize("g,blocks", [(1, None), (2, None), (1, 1)])
def test_forward_matches_dense_masked_attention(monkeypatch, g, blocks):
    if blocks:
        monkeypatch.setattr(_blocks, "MAX_BLOCK_ELEMENTS", blocks)
    q, kv, idx = random_case(9, 11, 4, g, 12, 5, seed=g)
    out, lse = sparse_mla_fwd_interface(q, kv, idx, sm_scale=0.37, d_v=8)
    ref_out, ref_lse = dense_reference(q, kv, idx, 0.37, 8)
    assert out.shape == (9, 4, 8) and lse.shape == (9, 4)
    assert (out - ref_out).abs().max() < 1e-12 and (lse - ref_lse).abs().max() < 1e-12


def test_default_scale_is_one_over_sqrt_of_the_full_dim():
    q, kv, idx = random_case(5, 5, 2, 1, 12, 3, seed=3)
    out, lse = sparse_mla_fwd_interface(q, kv, idx, d_v=8)
    ref_out, ref_lse = dense_reference(q, kv, idx, 12 ** -0.5, 8)
    assert (out - ref_out).abs().max() < 1e-12 and (lse - ref_lse).abs().max() < 1e-12


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3), topk=st.integers(1, 8), seed=st.integers(0, 99))
def test_varlen_indexer_selection_then_attention(lengths, topk, seed):
    """The indexer's own selection (causal per segment, -1 padded where a query has < topk keys)."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    starts, ends = generate_varlen_mask_params(cu)
    t = int(cu[-1])
    gen = torch.Generator().manual_seed(seed)
    iq, ik, iw = torch.randn(t, 2, 4, generator=gen), torch.randn(t, 4, generator=gen), torch.rand(t, 2, generator=gen)
    _, idx = lighting_indexer(iq, ik, iw, starts.int(), ends.int(), topk)
    q = torch.randn(t, 2, 6, generator=gen, dtype=torch.float64)
    kv = torch.randn(t, 1, 6, generator=gen, dtype=torch.float64)
    out, lse = sparse_mla_fwd_interface(q, kv, idx[:, None, :].contiguous(), sm_scale=0.5, d_v=4)
    ref_out, ref_lse = dense_reference(q, kv, idx[:, None, :], 0.5, 4)
    assert (out - ref_out).abs().max() < 1e-12 and (lse - ref_lse).abs().max() < 1e-12


def test_a_query_without_valid_keys_gets_zero_output_and_no_nan_gradient():
    q, kv, idx = random_case(4, 6, 2, 1, 6, 3, seed=4)
    idx[2] = -1
    idx[3, 0, 1] = 99  # out of range counts as padding
    qr, kvr = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse = SparseMLA.apply(qr, kvr, idx, 0.5, 4)
    assert torch.equal(out[2], torch.zeros(2, 4, dtype=out.dtype)) and torch.isinf(lse[2]).all()
    out.sum().backward()
    assert torch.isfinite(qr.grad).all() and torch.isfinite(kvr.grad).all()
    assert torch.equal(qr.grad[2], torch.zeros_like(qr.grad[2]))
    idx3 = idx.clone()
    idx3[3, 0, 1] = -1
    ref_out, _ = dense_reference(q, kv, idx3, 0.5, 4)
    assert (out[3] - ref_out[3]).abs().max() < 1e-12


@pytest.mark.parametrize("g,blocks", [(1, None), (2, None), (2, 1)])
def test_backward_matches_autograd_of_the_dense_reference(monkeypatch, g, blocks):
    if blocks:
        monkeypatch.setattr(_blocks, "MAX_BLOCK_ELEMENTS", blocks)
    q, kv, idx = random_case(7, 9, 4, g, 10, 4, seed=10 + g)
    out, lse = sparse_mla_fwd_interface(q, kv, idx, sm_scale=0.4, d_v=6)
    do = torch.randn_like(out)
    dq, dkv = sparse_mla_bwd(q, kv, out, do, idx, lse, sm_scale=0.4)
    qr, kvr = q.clone().requires_grad_(), kv.clone().requires_grad_()
    (dense_reference(qr, kvr, idx, 0.4, 6)[0] * do).sum().backward()
    assert (dq - qr.grad).abs().max() < 1e-12 and (dkv - kvr.grad).abs().max() < 1e-12


def test_lse_gradient_is_honoured_by_the_autograd_function():
    q, kv, idx = random_case(5, 6, 2, 1, 6, 3, seed=20)
    g_out, g_lse = torch.randn(5, 2, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    qr, kvr = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse = SparseMLA.apply(qr, kvr, idx, 0.5, 4)
    ((out * g_out).sum() + (lse * g_lse).sum()).backward()
    qd, kvd = q.clone().requires_grad_(), kv.clone().requires_grad_()
    ref_out, ref_lse = dense_reference(qd, kvd, idx, 0.5, 4)
    ((ref_out * g_out).sum() + (ref_lse * g_lse).sum()).backward()
    assert (qr.grad - qd.grad).abs().max() < 1e-12 and (kvr.grad - kvd.grad).abs().max() < 1e-12


def test_sparse_mla_gradcheck_float64():
    q, kv, idx = random_case(4, 5, 2, 1, 5, 3, seed=30)
    args = (q.clone().requires_grad_(), kv.clone().requires_grad_())
    assert torch.autograd.gradcheck(lambda a, b: SparseMLA.apply(a, b, idx, 0.6, 3), args)


def test_bf16_dtypes_follow_the_kernel_and_stay_close():
    q, kv, idx = random_case(6, 8, 4, 1, 16, 4, seed=40)
    qb, kvb = q.bfloat16(), kv.bfloat16()
    out, lse = sparse_mla_fwd_interface(qb, kvb, idx, sm_scale=0.25, d_v=12)
    assert (out.dtype, lse.dtype) == (torch.bfloat16, torch.float32)
    ref_out, ref_lse = dense_reference(qb.double(), kvb.double(), idx, 0.25, 12)
    assert (out.double() - ref_out).abs().max() < 2e-2 and (lse.double() - ref_lse).abs().max() < 1e-4
    dq, dkv = sparse_mla_bwd(qb, kvb, out, torch.ones_like(out), idx, lse, sm_scale=0.25)
    assert (dq.dtype, dkv.dtype, dq.shape, dkv.shape) == (torch.bfloat16, torch.bfloat16, qb.shape, kvb.shape)


def test_bad_arguments_are_refused_in_one_line():
    q, kv, idx = random_case(3, 3, 2, 1, 6, 2, seed=50)
    for kwargs, field in (({"d_v": 512}, "d_v=512"), ({"return_p_sum": True}, "return_p_sum")):
        with pytest.raises(ValueError, match=field) as err:
            sparse_mla_fwd_interface(q, kv, idx, **kwargs)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="^indices has shape"):
        sparse_mla_fwd_interface(q, kv, idx[:2], d_v=4)

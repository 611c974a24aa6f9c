"""Sparse multi-latent attention over the indexer's selected keys, in plain torch, with slime's interfaces.

Mirrors (``slime_plugins/models/glm5/ops/``):

* ``tilelang_sparse_mla_fwd.py:172 sparse_mla_fwd_interface`` -> :func:`sparse_mla_fwd_interface`
* ``tilelang_sparse_mla_bwd.py:271 sparse_mla_bwd`` -> :func:`sparse_mla_bwd`
* ``sparse_mla.py:7 SparseMLA`` -> :class:`SparseMLA`

Shapes (absorbed MLA, one latent "KV head" per group): ``q`` [T, H, D + D_tail], ``kv`` [T_kv, G, D + D_tail]
(the latent ``kv[..., :d_v]`` is also the value), ``indices`` [T, G, topk] int (``-1`` pads; an entry outside
``[0, T_kv)`` is treated as padding too, where the kernel would read out of bounds). Head ``h`` attends with
group ``h // (H // G)``. For query ``i``, head ``h`` and its selected keys ``j``::

    p_ij = softmax_j(sm_scale * q_ih . kv_j)        out_ih = sum_j p_ij kv_j[:d_v]
    lse_ih = log2(sum_j exp(sm_scale * q_ih . kv_j))   (base 2, as the kernel returns it)

``sm_scale`` defaults to ``(D + D_tail) ** -0.5``. ``out`` is in ``q``'s dtype, ``lse`` float32 (float64 for
float64 inputs); products are accumulated in float32. A query with no valid index gets ``out = 0`` and
``lse = -inf`` (the kernel divides 0 by 0 there; causal selection always keeps the query itself).

Memory: each query block gathers its own ``[block, G, topk, D + D_tail]`` keys (no ``[T, T_kv]`` or
``[T, H, T_kv]`` tensor), bounded by :data:`._blocks.MAX_BLOCK_ELEMENTS`.

Backward: the kernel's (``dS = P * (dP - Delta) * sm_scale``, ``Delta = rowsum(out * d_out)``), ``dq`` in
``q``'s dtype and ``dkv`` in ``kv``'s. slime's kernel ignores the gradient of ``lse``; :class:`SparseMLA`
here honours it (``Delta - grad_lse / ln 2``), which is the same whenever ``lse`` is unused, as in ``glm5.py``.
"""

from __future__ import annotations

import math

import torch

from ._blocks import check_shape, compute_dtype, query_blocks, valid_indices

__all__ = ["sparse_mla_fwd_interface", "sparse_mla_bwd", "SparseMLA"]

_LN2 = math.log(2.0)


def _check(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor) -> tuple[int, int, int]:
    """``(H, G, D + D_tail)`` after checking the three shapes agree; one-line errors name the field."""
    check_shape("q", q, (None, None, None), "queries are [T, heads, dim + tail_dim]")
    seq_len, heads, dim = q.shape
    check_shape("kv", kv, (None, None, dim), "kv is [T_kv, kv_group, dim + tail_dim], the queries' last dim")
    group = kv.shape[1]
    check_shape("indices", indices, (seq_len, group, None), "indices are [T, kv_group, topk]")
    if group == 0 or heads % group:
        raise ValueError(f"q has {heads} heads, not a multiple of kv's kv_group {group}: use H = n * kv_group")
    return heads, group, dim


def _gather(kv_groups: torch.Tensor, safe: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """The selected keys [B, G, topk, dim] of ``kv_groups`` [G, T_kv, dim] at ``safe`` [B, G, topk]."""
    group = torch.arange(kv_groups.shape[0], device=safe.device)[None, :, None]
    return kv_groups[group, safe].to(dt)


def sparse_mla_fwd_interface(
    q, kv, indices, sm_scale=None, return_p_sum: bool = False, d_v=512, block_I=64, num_stages=2, threads=256
):
    """``(out [T, H, d_v], lse [T, H])`` of sparse attention over ``indices``; ``block_I``, ``num_stages`` and
    ``threads`` are the kernel's tiling and are ignored here."""
    if return_p_sum:
        raise ValueError("return_p_sum=True is not supported (slime's kernel refuses it too): pass False")
    heads, group, dim = _check(q, kv, indices)
    if not 0 < int(d_v) <= dim:
        raise ValueError(f"d_v={d_v} must be in [1, {dim}] (the value is kv[..., :d_v]): pass d_v=kv_lora_rank")
    d_v = int(d_v)
    scale = dim ** -0.5 if sm_scale is None else float(sm_scale)
    seq_len, seq_len_kv, topk = q.shape[0], kv.shape[0], indices.shape[-1]
    hg = heads // group
    dt = compute_dtype(q, kv)
    out = torch.empty((seq_len, heads, d_v), dtype=dt, device=q.device)
    lse = torch.empty((seq_len, heads), dtype=dt, device=q.device)
    kv_groups = kv.transpose(0, 1)
    for s, e in query_blocks(seq_len, group * topk * (dim + 2 * hg)):
        valid, safe = valid_indices(indices[s:e], seq_len_kv)
        keys = _gather(kv_groups, safe, dt)  # [B, G, topk, dim]
        qb = q[s:e].to(dt).reshape(e - s, group, hg, dim)
        scores = torch.einsum("bghd,bgkd->bghk", qb, keys) * scale
        scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
        lse_e = torch.logsumexp(scores, dim=-1)  # natural log; -inf for a row with no valid key
        p = torch.exp(scores - torch.where(torch.isinf(lse_e), torch.zeros_like(lse_e), lse_e)[..., None])
        out[s:e] = torch.einsum("bghk,bgkd->bghd", p, keys[..., :d_v]).reshape(e - s, heads, d_v)
        lse[s:e] = (lse_e / _LN2).reshape(e - s, heads)
    return out.to(q.dtype), lse


def sparse_mla_bwd(q, kv, o, do, indices, lse, sm_scale=None, is_casual=True, return_kernel=False, delta=None):
    """``(dq, dkv)`` of :func:`sparse_mla_fwd_interface`'s ``out`` given ``do``; ``d_v`` is ``o``'s last dim,
    ``lse`` the forward's (base 2), ``delta`` [T, H] defaults to ``rowsum(o * do)``. ``is_casual`` and
    ``return_kernel`` are accepted for the kernel's signature and ignored (as slime's interface does)."""
    heads, group, dim = _check(q, kv, indices)
    seq_len, seq_len_kv, topk = q.shape[0], kv.shape[0], indices.shape[-1]
    d_v = o.shape[-1]
    check_shape("o", o, (seq_len, heads, None), "o is the forward's output [T, H, d_v]")
    check_shape("do", do, tuple(o.shape), "do is the gradient of o")
    check_shape("lse", lse, (seq_len, heads), "lse is the forward's [T, H]")
    if not 0 < d_v <= dim:
        raise ValueError(f"o has d_v={d_v}, expected 1..{dim} (the dims of kv that are the value)")
    scale = dim ** -0.5 if sm_scale is None else float(sm_scale)
    hg = heads // group
    dt = compute_dtype(q, kv, o, do, lse)
    if delta is None:
        delta = (o.to(dt) * do.to(dt)).sum(-1)
    check_shape("delta", delta, (seq_len, heads), "delta is rowsum(o * do), [T, H]")
    dq = torch.empty((seq_len, heads, dim), dtype=dt, device=q.device)
    dkv = torch.zeros((group * seq_len_kv, dim), dtype=dt, device=q.device)  # group-major rows
    kv_groups = kv.transpose(0, 1)
    offsets = (torch.arange(group, device=q.device) * seq_len_kv)[None, :, None]
    for s, e in query_blocks(seq_len, group * topk * (2 * dim + 3 * hg)):
        b = e - s
        valid, safe = valid_indices(indices[s:e], seq_len_kv)
        keys = _gather(kv_groups, safe, dt)
        qb = q[s:e].to(dt).reshape(b, group, hg, dim)
        dob = do[s:e].to(dt).reshape(b, group, hg, d_v)
        log_p = torch.einsum("bghd,bgkd->bghk", qb, keys) * scale - lse[s:e].to(dt).reshape(b, group, hg, 1) * _LN2
        p = torch.where(valid[:, :, None, :], torch.exp(log_p), torch.zeros((), dtype=dt, device=q.device))
        dp = torch.einsum("bghd,bgkd->bghk", dob, keys[..., :d_v])
        ds = p * (dp - delta[s:e].to(dt).reshape(b, group, hg, 1)) * scale
        dq[s:e] = torch.einsum("bghk,bgkd->bghd", ds, keys).reshape(b, heads, dim)
        dkeys = torch.einsum("bghk,bghd->bgkd", ds, qb)
        dkeys[..., :d_v] += torch.einsum("bghk,bghd->bgkd", p, dob)
        dkeys = dkeys * valid[..., None]
        dkv.index_add_(0, (safe + offsets).reshape(-1), dkeys.reshape(-1, dim))
    return dq.to(q.dtype), dkv.reshape(group, seq_len_kv, dim).transpose(0, 1).to(kv.dtype).contiguous()


class SparseMLA(torch.autograd.Function):
    """slime's ``SparseMLA``: ``(out, lse)``; gradients for ``q`` and ``kv``. ``d_v`` (default 512, slime's
    fixed latent width) is an extra trailing argument, as in slime's ``SGLangSparseMLA``."""

    @staticmethod
    def forward(ctx, q, kv, indices, scaling, d_v=512):
        out, lse = sparse_mla_fwd_interface(q, kv, indices, sm_scale=scaling, d_v=d_v)
        ctx.scaling = scaling
        ctx.save_for_backward(q, kv, indices, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_output, grad_lse):
        q, kv, indices, out, lse = ctx.saved_tensors
        dt = compute_dtype(q, kv, out, grad_output)
        delta = (out.to(dt) * grad_output.to(dt)).sum(-1)
        if grad_lse is not None:
            delta = delta - grad_lse.to(dt) / _LN2  # d lse / d s = scale * p / ln 2
        dq, dkv = sparse_mla_bwd(q, kv, out, grad_output, indices, lse, sm_scale=ctx.scaling, delta=delta)
        return dq, dkv, None, None, None

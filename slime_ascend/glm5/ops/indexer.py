"""The DSA lightning indexer of slime's GLM-5 spec in plain torch, with the interfaces of slime's modules.

Mirrors (``slime_plugins/models/glm5/ops/``):

* ``tilelang_indexer_fwd.py:121 indexer_fwd_interface`` -> :func:`indexer_fwd_interface`
* ``tilelang_indexer_bwd.py:139 indexer_bwd_interface`` -> :func:`indexer_bwd_interface`
* ``indexer.py`` ``pytorch_extract_topk_scores`` (:79), ``pytorch_topk_with_invalid_padding`` (:87),
  ``IndexerFunction`` (:122), ``lighting_indexer`` (:176), ``generate_varlen_mask_params`` (:188)

Scores. For query ``i`` (heads ``h``) and key ``j``: ``logits[i, j] = sum_h relu(q[i, h] . k[j]) * w[i, h]``
for ``cu_seqlen_ks[i] <= j < cu_seqlen_ke[i]`` (both clamped to ``[0, T_kv]``), ``-inf`` elsewhere
(``clean_logits=True``; with ``False`` the kernel leaves some entries unwritten, here they are the scores of
the query block's key range and ``-inf`` outside it). Products of bf16 inputs are accumulated in float32 as
the kernel's GEMM does; ``logits`` is float32 (float64 when an input is float64). The ``[block, H, keys]``
intermediate is computed one query block at a time (:data:`._blocks.MAX_BLOCK_ELEMENTS`).

Selection. :func:`pytorch_topk_with_invalid_padding` is slime's layout (``[T, topk]`` scores best first,
int32 indices, ``-1`` / ``-inf`` for ``-inf`` keys and for rows shorter than ``topk``) under the package's
``dsa-determinism`` rule (:func:`slime_ascend.dsa.indexer.topk_with_invalid_padding`): ties go to the lower
index, ``-inf`` keys are never selected, NaN scores raise ``ValueError``.

Backward. slime defines no indexer loss in its GLM-5 spec: ``glm5.py`` softmaxes the returned scores and
discards them (``_, topk_indices = fused_select_topk(...)``), and the backward kernel is the plain
vector-Jacobian product of the *gathered* scores ``index_score[i, s] = logits[i, topk_indices[i, s]]``
(``-1`` slots contribute nothing; the relu's derivative at 0 is 0). :class:`IndexerFunction` returns
gradients for ``index_q``, ``index_k`` and ``weights``, ``None`` for the rest, as slime's does.
"""

from __future__ import annotations

import torch

from ...dsa.indexer import topk_with_invalid_padding
from ._blocks import check_shape, compute_dtype, query_blocks, valid_indices

__all__ = [
    "indexer_fwd_interface",
    "indexer_bwd_interface",
    "pytorch_extract_topk_scores",
    "pytorch_topk_with_invalid_padding",
    "IndexerFunction",
    "lighting_indexer",
    "generate_varlen_mask_params",
]

_NEG_INF = float("-inf")


def _key_matrix(name: str, k: torch.Tensor, index_dim: int) -> torch.Tensor:
    """The indexer keys as [T_kv, index_dim] (one key head: [T_kv, 1, index_dim] is accepted too)."""
    if k.dim() == 3 and k.shape[1] == 1:
        k = k.squeeze(1)
    check_shape(name, k, (None, index_dim), "the indexer has one key head of the queries' index_dim")
    return k


def _head_weights(name: str, w: torch.Tensor, seq_len: int, heads: int) -> torch.Tensor:
    """The per-head weights as [T, H] (slime passes [T, H] or [T, H, 1])."""
    if w.dim() == 3 and w.shape[-1] == 1:
        w = w.squeeze(-1)
    check_shape(name, w, (seq_len, heads), "one weight per query and indexer head")
    return w


def indexer_fwd_interface(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=True):
    """Indexer scores ``logits`` [T, T_kv] of queries ``q`` [T, H, D] over keys ``kv`` [T_kv, D] with head
    weights ``weights`` [T, H]; key range of query ``i`` is ``[cu_seqlen_ks[i], cu_seqlen_ke[i])``."""
    check_shape("q", q, (None, None, None), "index queries are [T, heads, index_dim]")
    seq_len, heads, index_dim = q.shape
    kv = _key_matrix("kv", kv, index_dim)
    w = _head_weights("weights", weights, seq_len, heads)
    check_shape("cu_seqlen_ks", cu_seqlen_ks, (seq_len,), "one key start per query")
    check_shape("cu_seqlen_ke", cu_seqlen_ke, (seq_len,), "one key end per query")
    seq_len_kv = kv.shape[0]
    dt = compute_dtype(q, kv, weights)
    ks = cu_seqlen_ks.long().clamp(0, seq_len_kv)
    ke = cu_seqlen_ke.long().clamp(0, seq_len_kv)
    logits = torch.full((seq_len, seq_len_kv), _NEG_INF, dtype=dt, device=q.device)
    starts, ends = ks.tolist(), ke.tolist()  # one host copy: each block's key range, as the kernel's
    keys = kv.to(dt)
    for s, e in query_blocks(seq_len, heads * seq_len_kv):
        lo, hi = min(starts[s:e]), max(ends[s:e])
        if hi <= lo:
            continue
        per_head = torch.einsum("bhd,nd->bhn", q[s:e].to(dt), keys[lo:hi]).clamp_(min=0)
        logits[s:e, lo:hi] = torch.einsum("bhn,bh->bn", per_head, w[s:e].to(dt))
    if clean_logits:
        cols = torch.arange(seq_len_kv, device=q.device)
        logits.masked_fill_((cols < ks[:, None]) | (cols >= ke[:, None]), _NEG_INF)
    return logits


def indexer_bwd_interface(index_q, weights, index_k, topk_indices, grad_scores):
    """Gradients ``(grad_q, grad_w, grad_k)`` of the gathered scores ``logits[i, topk_indices[i, s]]`` given
    ``grad_scores`` [T, topk]: ``grad_q`` in ``index_q``'s dtype, ``grad_w`` / ``grad_k`` float32 (float64
    for float64 inputs) in the shapes of ``weights`` / ``index_k``. Slots ``-1`` (or out of range) add
    nothing, whatever their ``grad_scores``."""
    check_shape("index_q", index_q, (None, None, None), "index queries are [T, heads, index_dim]")
    seq_len, heads, index_dim = index_q.shape
    k = _key_matrix("index_k", index_k, index_dim)
    w_shape = weights.shape
    w = _head_weights("weights", weights, seq_len, heads)
    check_shape("topk_indices", topk_indices, (seq_len, None), "one row of selected keys per query")
    check_shape("grad_scores", grad_scores, tuple(topk_indices.shape), "one gradient per selected key")
    seq_len_kv, topk = k.shape[0], topk_indices.shape[1]
    dt = compute_dtype(index_q, index_k, weights)
    keys = k.to(dt)
    grad_q = torch.empty((seq_len, heads, index_dim), dtype=dt, device=index_q.device)
    grad_w = torch.empty((seq_len, heads), dtype=dt, device=index_q.device)
    grad_k = torch.zeros((seq_len_kv, index_dim), dtype=dt, device=index_q.device)
    for s, e in query_blocks(seq_len, topk * (index_dim + 2 * heads)):
        valid, safe = valid_indices(topk_indices[s:e], seq_len_kv)
        kg = keys[safe] * valid[..., None]  # [B, topk, D]; an invalid slot reads a zero key (as the kernel)
        qb, wb = index_q[s:e].to(dt), w[s:e].to(dt)
        g = torch.where(valid, grad_scores[s:e].to(dt), torch.zeros((), dtype=dt, device=kg.device))
        dots = torch.einsum("bhd,bkd->bkh", qb, kg)
        grad_w[s:e] = torch.einsum("bkh,bk->bh", dots.clamp(min=0), g)
        coef = (dots > 0).to(dt) * g[..., None] * wb[:, None, :]  # d score / d dot, [B, topk, H]
        grad_q[s:e] = torch.einsum("bkh,bkd->bhd", coef, kg)
        grad_k.index_add_(0, safe.reshape(-1), torch.einsum("bkh,bhd->bkd", coef, qb).reshape(-1, index_dim))
    acc = torch.float64 if dt == torch.float64 else torch.float32
    return grad_q.to(index_q.dtype), grad_w.to(acc).reshape(w_shape), grad_k.to(acc).reshape(index_k.shape)


def pytorch_extract_topk_scores(logits, topk_indices, dim=-1):
    """``logits`` gathered at ``topk_indices`` along ``dim``, ``-inf`` where an index is ``-1``."""
    valid_mask = topk_indices != -1
    scores = torch.gather(logits, dim=dim, index=topk_indices.clamp(min=0).to(torch.int64))
    return torch.where(valid_mask, scores, torch.full((), _NEG_INF, dtype=scores.dtype, device=scores.device))


def pytorch_topk_with_invalid_padding(logits: torch.Tensor, topk: int):
    """``(scores, indices)`` [..., topk]: slime's layout, the ``dsa-determinism`` selection rule."""
    return topk_with_invalid_padding(logits, topk)


class IndexerFunction(torch.autograd.Function):
    """slime's ``IndexerFunction``: ``(index_score, topk_indices)``; ``topk_indices`` given is reused."""

    @staticmethod
    def forward(ctx, index_q, index_k, weights, cu_seqlen_ks, cu_seqlen_ke, topk, topk_indices=None):
        logits = indexer_fwd_interface(index_q, index_k, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=True)
        if topk_indices is None:
            _, topk_indices = pytorch_topk_with_invalid_padding(logits, topk)
        index_score = pytorch_extract_topk_scores(logits, topk_indices)
        ctx.save_for_backward(index_q, index_k, weights, topk_indices)
        return index_score, topk_indices

    @staticmethod
    def backward(ctx, grad_scores, grad_indices):
        index_q, index_k, weights, topk_indices = ctx.saved_tensors
        grad_q, grad_w, grad_k = indexer_bwd_interface(index_q, weights, index_k, topk_indices, grad_scores)
        return grad_q, grad_k, grad_w, None, None, None, None


def lighting_indexer(index_q, index_k, weights, cu_seqlen_ks, cu_seqlen_ke, topk, topk_indices=None):
    """slime's entry point (its spelling): ``weights`` [T, H, 1] or [T, H]; returns ``(scores, indices)``."""
    return IndexerFunction.apply(index_q, index_k, weights.squeeze(-1), cu_seqlen_ks, cu_seqlen_ke, topk, topk_indices)


def generate_varlen_mask_params(cu_seqlens):
    """Causal key ranges of packed sequences: ``starts[i]`` = its sequence's first token, ``ends[i] = i + 1``."""
    seq_len = int(cu_seqlens[-1].item())
    q_indices = torch.arange(0, seq_len, device=cu_seqlens.device)
    seq_indices = torch.searchsorted(cu_seqlens, q_indices, right=True) - 1
    starts = cu_seqlens[seq_indices]
    ends = q_indices + 1
    if seq_len and not bool(torch.all((ends - starts) > 0)):
        raise ValueError("cu_seqlens must start at 0 and be non-decreasing (every query needs a key)")
    return starts, ends

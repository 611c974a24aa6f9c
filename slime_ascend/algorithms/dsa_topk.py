"""Deterministic DSA indexer top-k as (values, indices), its merge across key shards, index-set agreement.

Pure torch (no slime, no Megatron). The selection rule is the one of :mod:`slime_ascend.algorithms.topk`
(DESIGN.md "Numerical conventions", deterministic top-k):

* total order: score desc, then index asc (``-0.0`` and ``+0.0`` are equal scores);
* NaN scores are rejected with ``ValueError``;
* keys scored ``-inf`` are never selected; a row with fewer than ``k`` selectable keys is padded.

:func:`deterministic_topk` returns that selection in the layout of ``torch.topk(sorted=True)``, which
is what slime's DSA indexer (``slime_plugins/models/glm5/ops/indexer.py``) consumes: ``values`` in the
dtype of ``scores``, best first, ties in ascending index order; padding slots (``-inf`` keys, rows
shorter than ``k``) hold value ``-inf`` and index ``-1`` at the end; ``indices`` in ``index_dtype``.

**Merge rule for key-sharded scoring** (context- or tensor-parallel shards that each hold a contiguous
range of the keys, of any sizes, empty allowed): shard ``s`` with global key offset ``o_s`` computes its
local deterministic top-k and adds ``o_s`` to the indices (:func:`local_topk_candidates`); the merge
(:func:`merge_topk_candidates`) takes the best ``k`` of all shards' candidates under the same total order
on ``(value, global index)``. The result equals the unsharded :func:`deterministic_topk` exactly
(values, indices and their order):

    Let T be the unsharded top-k set and x in T a key of shard s. Every key of shard s that ranks
    above x also ranks above x globally, and fewer than k keys rank above x globally (x in T), so x is
    in shard s's local top-k: T is contained in the candidate set C, and C is contained in all keys U.
    Under a total order the first k elements of U all lie in C, so they are also the first k of C:
    top-k(C) = T. The -inf rule is applied per key (never selectable) and NaN is rejected in every
    shard, so both agree with the unsharded rule; a row with fewer than k selectable keys keeps all of
    them in some shard's candidates (each shard keeps up to k of its own). The output order is fixed
    by the total order, hence equal too.

It holds for keys split along the key dimension only. Scores whose *heads* are split (the indexer's
weighted sum over heads under TP) must be reduced to full scores first; the merge cannot recover a sum.

:func:`index_set_agreement` measures how far two numeric paths (e.g. fp32 vs bf16 indexer scores) are
from selecting the same keys: fraction of rows with identical index sets and mean Jaccard.

All sorts are stable sorts on keys where ``-0.0`` is mapped to ``+0.0`` (``x + 0.0``), so a radix sort on
the float's bits (CUDA) and a comparison sort (CPU) order the same; no result depends on the tie order
of ``torch.topk``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .topk import deterministic_topk_indices

__all__ = [
    "deterministic_topk",
    "local_topk_candidates",
    "merge_topk_candidates",
    "sharded_deterministic_topk",
    "index_set_agreement",
    "topk_jaccard",
]

_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_float(scores: torch.Tensor, what: str = "scores") -> None:
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(scores).__name__}")
    if not scores.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor (padding is -inf), got dtype {scores.dtype}")


def _check_index_dtype(index_dtype: torch.dtype) -> None:
    if index_dtype not in _INDEX_DTYPES:
        raise TypeError(f"index_dtype must be torch.int32 or torch.int64, got {index_dtype}")


def _order_desc(values: torch.Tensor) -> torch.Tensor:
    """Stable descending order of ``values`` along the last dim, with -0.0 == +0.0 on every device."""
    return torch.sort(values + 0.0, dim=-1, descending=True, stable=True).indices


def deterministic_topk(
    scores: torch.Tensor, k: int, *, index_dtype: torch.dtype = torch.int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best keys of ``scores`` [..., L] as ``(values, indices)``, each [..., k].

    ``values`` (dtype of ``scores``): best first, ties in ascending index order, then ``-inf`` padding.
    ``indices`` (``index_dtype``): the keys' positions, ``-1`` in every padding slot. ``k > L`` pads.

    Raises:
        TypeError: ``scores`` is not a floating-point tensor, or a bad ``index_dtype`` / ``k``.
        ValueError: ``scores`` contains NaN, is 0-d, or ``k < 0``.
    """
    _check_float(scores)
    _check_index_dtype(index_dtype)
    asc = deterministic_topk_indices(scores, k)  # validates k, 0-d and NaN; ascending, -1 padded at the end
    valid = asc >= 0
    if scores.shape[-1] == 0:
        values = torch.full(asc.shape, float("-inf"), dtype=scores.dtype, device=scores.device)
    else:
        values = scores.gather(-1, asc.clamp(min=0))
        values = values.masked_fill(~valid, float("-inf"))
    # Valid keys are > -inf and come before the padding; a stable sort keeps ascending index order in ties.
    order = _order_desc(values)
    return values.gather(-1, order), asc.gather(-1, order).to(index_dtype)


def local_topk_candidates(
    scores_shard: torch.Tensor, k: int, offset: int, *, index_dtype: torch.dtype = torch.int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """One key shard's candidates: its :func:`deterministic_topk` with indices shifted by ``offset``.

    ``scores_shard`` [..., L_s] holds the global keys ``offset .. offset + L_s - 1``. Padding stays ``-1``.
    """
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be an int >= 0, got {offset!r}")
    _check_index_dtype(index_dtype)
    values, idx = deterministic_topk(scores_shard, k, index_dtype=torch.int64)
    idx = torch.where(idx >= 0, idx + offset, idx)
    if index_dtype == torch.int32 and idx.numel() and int(idx.max()) > torch.iinfo(torch.int32).max:
        raise ValueError("a global index does not fit int32; use index_dtype=torch.int64")
    return values, idx.to(index_dtype)


def merge_topk_candidates(
    values: torch.Tensor | Sequence[torch.Tensor],
    indices: torch.Tensor | Sequence[torch.Tensor],
    k: int,
    *,
    index_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge key shards' candidates into the deterministic top-k of all keys (rule in the module docstring).

    Args:
        values, indices: the shards' :func:`local_topk_candidates`, as sequences (concatenated along the
            last dim) or already concatenated tensors [..., M]. A candidate with index ``-1`` or value
            ``-inf`` is padding. Global indices must not repeat within a row (overlapping shards).
        k: width of the result.
        index_dtype: dtype of the returned indices (default: that of ``indices``).

    Returns:
        ``(values, indices)`` [..., k] in the layout of :func:`deterministic_topk`.

    Raises:
        ValueError: NaN among the values, a repeated global index, mismatched shapes, ``k < 0``.
    """
    if not isinstance(values, torch.Tensor):
        values = torch.cat(list(values), dim=-1)
    if not isinstance(indices, torch.Tensor):
        indices = torch.cat(list(indices), dim=-1)
    _check_float(values, "values")
    if indices.is_floating_point() or indices.dtype == torch.bool or indices.is_complex():
        raise TypeError(f"indices must be an integer tensor, got dtype {indices.dtype}")
    if values.shape != indices.shape or values.dim() == 0:
        raise ValueError(f"values and indices must share a shape [..., M], got {tuple(values.shape)} "
                         f"and {tuple(indices.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an int >= 0, got {k!r}")
    out_dtype = indices.dtype if index_dtype is None else index_dtype
    _check_index_dtype(out_dtype)
    if values.numel() and bool(torch.isnan(values).any()):
        raise ValueError("candidate values contain NaN; scores with NaN are rejected before top-k")

    idx = indices.to(torch.int64)
    valid = (idx >= 0) & (values != float("-inf"))
    big = torch.iinfo(torch.int64).max
    key_idx = torch.where(valid, idx, torch.full_like(idx, big))
    vals = values.masked_fill(~valid, float("-inf"))
    # 1) ascending global index (stable), 2) stable descending value: ties keep the lower index first.
    by_index = torch.sort(key_idx, dim=-1, stable=True)
    key_idx = by_index.values
    vals = vals.gather(-1, by_index.indices)
    if key_idx.shape[-1] > 1 and bool(((key_idx[..., 1:] == key_idx[..., :-1]) & (key_idx[..., 1:] != big)).any()):
        raise ValueError("a global index appears in two candidates of one row: the shards overlap")
    order = _order_desc(vals)
    vals, key_idx = vals.gather(-1, order), key_idx.gather(-1, order)
    m = vals.shape[-1]
    vals, key_idx = vals[..., : min(k, m)], key_idx[..., : min(k, m)]
    key_idx = torch.where(key_idx == big, torch.full_like(key_idx, -1), key_idx)
    if m < k:
        pad = (*vals.shape[:-1], k - m)
        vals = torch.cat([vals, vals.new_full(pad, float("-inf"))], dim=-1)
        key_idx = torch.cat([key_idx, key_idx.new_full(pad, -1)], dim=-1)
    return vals, key_idx.to(out_dtype)


def sharded_deterministic_topk(
    scores: torch.Tensor, k: int, split_sizes: Sequence[int], *, index_dtype: torch.dtype = torch.int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sharded path in one process: split ``scores`` [..., L] along the keys into ``split_sizes``
    (summing to L, zeros allowed), take each shard's candidates, merge. Equals :func:`deterministic_topk`."""
    _check_float(scores)
    sizes = [int(s) for s in split_sizes]
    if any(s < 0 for s in sizes) or sum(sizes) != scores.shape[-1]:
        raise ValueError(f"split_sizes {sizes} must be >= 0 and sum to L = {scores.shape[-1]}")
    values, indices, offset = [], [], 0
    for size in sizes:
        v, i = local_topk_candidates(scores[..., offset: offset + size], k, offset)
        values.append(v)
        indices.append(i)
        offset += size
    if not sizes:
        return deterministic_topk(scores, k, index_dtype=index_dtype)
    return merge_topk_candidates(values, indices, k, index_dtype=index_dtype)


def topk_jaccard(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row Jaccard |A ∩ B| / |A ∪ B| of two index sets [..., k] (``-1`` ignored, any order within a
    row); 1.0 when both rows are empty. float64 [...]."""
    for name, t in (("a", a), ("b", b)):
        if t.is_floating_point() or t.dtype == torch.bool or t.is_complex():
            raise TypeError(f"{name} must be an integer tensor of indices, got dtype {t.dtype}")
    if a.shape[:-1] != b.shape[:-1] or a.dim() == 0:
        raise ValueError(f"a and b must share leading dims [..., k], got {tuple(a.shape)} and {tuple(b.shape)}")
    a64, b64 = a.long(), b.long()
    va, vb = a64 >= 0, b64 >= 0
    # |A ∩ B|: look every valid entry of A up in B's sorted row (indices within a row are distinct).
    big = torch.iinfo(torch.int64).max
    sb = torch.sort(torch.where(vb, b64, torch.full_like(b64, big)), dim=-1).values.contiguous()
    if sb.shape[-1] == 0:
        inter = torch.zeros(a64.shape[:-1], dtype=torch.long, device=a64.device)
    else:
        pos = torch.searchsorted(sb, a64.contiguous()).clamp(max=sb.shape[-1] - 1)
        inter = ((sb.gather(-1, pos) == a64) & va).sum(-1)
    union = va.sum(-1) + vb.sum(-1) - inter
    inter, union = inter.double(), union.double()
    return torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(inter))


def index_set_agreement(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Agreement of the index sets two numeric paths selected, rows [..., k] each (``-1`` = empty slot).

    Returns ``rows`` (number of rows), ``rows_identical_frac`` (rows whose sets are equal) and
    ``jaccard_mean`` / ``jaccard_min`` (of :func:`topk_jaccard`). Two empty inputs agree fully.
    """
    jac = topk_jaccard(a, b).reshape(-1)
    rows = int(jac.numel())
    if rows == 0:
        return {"rows": 0, "rows_identical_frac": 1.0, "jaccard_mean": 1.0, "jaccard_min": 1.0}
    return {
        "rows": rows,
        "rows_identical_frac": float((jac == 1.0).double().mean()),
        "jaccard_mean": float(jac.mean()),
        "jaccard_min": float(jac.min()),
    }

"""Deterministic top-k index selection for sparse attention (DSA lightning indexer), and index replay.

Specification (DESIGN.md "Numerical conventions", deterministic top-k):

* Total order: a key ranks above another iff its score is larger, or the scores are equal and its
  index is smaller (score desc, index asc). ``-0.0`` and ``+0.0`` are equal scores.
* NaN scores are rejected with ``ValueError``.
* Keys scored ``-inf`` are never selected: their slots come back as ``-1``.
* Rows shorter than ``k`` (``L < k``) are padded with ``-1`` to width ``k``.
* Output: the selected indices of each row in **ascending** order, ``-1`` padding at the end
  (the layout slime uses with ``MEGATRON_USE_SGLANG_FP8_INDEXER=1`` and SGLang produces).

Because the selected set is defined by a total order and emitted sorted, the result does not depend
on device, thread count or call; only the scores themselves have to be bitwise identical. When they
are not (e.g. FP8 rollout indexer vs BF16 trainer indexer), replay the rollout's recorded indices with
:func:`replay_topk_indices` instead of recomputing them.

Implementation: ``torch.topk`` with ``k + 1`` candidates gives the k-th largest value (the threshold)
and tells whether the (k+1)-th equals it. If not, the first ``k`` candidates are the unique answer
and are only sorted (whatever order torch.topk used for ties above the threshold). Otherwise the
slots holding threshold-valued keys are refilled with the lowest-index keys equal to the threshold
(one comparison pass and one ``nonzero``). No Python loop over rows or tokens; only ``torch.topk``'s
returned *values* are trusted, never its tie order. Host syncs: the NaN check and one for the
"any ties / any -inf" flags (plus ``nonzero`` when ties straddle).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "deterministic_topk_indices",
    "replay_topk_indices",
]


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be a Python int, got {type(k).__name__}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")


def deterministic_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` best keys along the last dim of ``scores`` ([..., L]) -> int64 [..., k].

    Order and padding rules are in the module docstring. Works on the device of ``scores``.

    Raises:
        TypeError: ``scores`` is not a real (float or integer) tensor, or ``k`` is not an int.
        ValueError: ``scores`` is 0-d, contains NaN, or ``k < 0``.
    """
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"scores must be a torch.Tensor, got {type(scores).__name__}")
    _check_k(k)
    if scores.dim() == 0:
        raise ValueError("scores must have at least one dim ([..., L]); got a 0-d tensor")
    if scores.dtype == torch.bool or scores.is_complex():
        raise TypeError(f"scores must be a real float or integer tensor, got dtype {scores.dtype}")

    batch_shape = scores.shape[:-1]
    length = scores.shape[-1]
    device = scores.device
    is_float = scores.is_floating_point()
    # NaN propagates through a sum, so the cheap reduction clears almost every input.
    if is_float and scores.numel() > 0 and bool(torch.isnan(scores.sum())) and bool(torch.isnan(scores).any()):
        raise ValueError("scores contain NaN; replace them (e.g. with -inf for masked keys) before top-k")

    kk = min(k, length)
    rows = math.prod(batch_shape)
    if kk == 0 or rows == 0:
        return torch.full((*batch_shape, k), -1, dtype=torch.long, device=device)

    x = scores.reshape(rows, length)
    if kk < length:
        # One extra candidate tells whether ties straddle the threshold (the kk-th largest value).
        values, cand = torch.topk(x, kk + 1, dim=-1, largest=True, sorted=True)
        straddle = values[:, kk] == values[:, kk - 1]
        values, cand = values[:, :kk], cand[:, :kk]
    else:
        values, cand = torch.topk(x, kk, dim=-1, largest=True, sorted=True)
        straddle = torch.zeros(rows, dtype=torch.bool, device=device)
    threshold = values[:, kk - 1]
    if is_float:
        has_neginf = threshold == float("-inf")  # the selection holds a -inf key iff its minimum is -inf
        straddle = straddle & ~has_neginf  # tied -inf keys all become -1: nothing to resolve
    else:
        has_neginf = torch.zeros_like(straddle)
    any_straddle, any_neginf = torch.stack([straddle.any(), has_neginf.any()]).tolist()  # one host sync

    if any_straddle:
        # Slots >= n_above hold keys tied at the threshold, in arbitrary order; refill them with the
        # lowest-index tied keys of the row. Tied keys are found with one pass and a sparse nonzero.
        cand = cand.clone()
        n_above = (values > threshold[:, None]).sum(dim=-1)
        if is_float:  # a NaN threshold matches nothing: rows without straddling ties drop out
            at = x == torch.where(straddle, threshold, torch.full_like(threshold, float("nan")))[:, None]
        else:
            at = (x == threshold[:, None]) & straddle[:, None]
        ties = torch.nonzero(at)  # row-major: ascending positions within each row
        t_row, t_pos = ties[:, 0], ties[:, 1]
        first = torch.searchsorted(t_row.contiguous(), torch.arange(rows, device=device))
        slot = n_above[t_row] + (torch.arange(t_row.numel(), device=device) - first[t_row])
        take = slot < kk
        cand[t_row[take], slot[take]] = t_pos[take]
    if any_neginf:
        # -inf keys are never selected: their slots become -1, moved to the end by the sort.
        cand = torch.where(values == float("-inf"), torch.full_like(cand, length), cand)
    idx = torch.sort(cand, dim=-1).values
    if any_neginf:
        idx = torch.where(idx == length, torch.full_like(idx, -1), idx)
    if kk < k:
        idx = torch.cat([idx, torch.full((rows, k - kk), -1, dtype=torch.long, device=device)], dim=-1)
    return idx.reshape(*batch_shape, k)


def replay_topk_indices(
    recorded: torch.Tensor,
    k: int,
    length: int,
    *,
    batch_shape: tuple[int, ...] | torch.Size | None = None,
    canonicalize: bool = False,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Validate top-k indices recorded at rollout and return them as int64 [..., k] for training.

    Index replay is the alternative to recomputing top-k when trainer and rollout scores differ.

    Args:
        recorded: integer tensor [..., k]; valid entries in ``[0, length)``; ``-1`` marks an empty slot.
        k: expected last-dim width.
        length: number of keys ``L`` the indices point into.
        batch_shape: if given, the expected leading shape.
        canonicalize: if False (default) the rows must already be canonical (valid entries strictly
            ascending, all ``-1`` after them); if True rows are sorted into that layout (duplicates still
            rejected).
        device: move the result there (default: stay on ``recorded.device``).

    Raises:
        TypeError: ``recorded`` is not an integer tensor.
        ValueError: wrong shape, an entry outside ``[-1, length)``, a duplicate index, or (without
            ``canonicalize``) a row that is not ascending with trailing ``-1`` padding.
    """
    if not isinstance(recorded, torch.Tensor):
        raise TypeError(f"recorded must be a torch.Tensor, got {type(recorded).__name__}")
    if recorded.is_floating_point() or recorded.is_complex() or recorded.dtype == torch.bool:
        raise TypeError(f"recorded must be an integer tensor of indices, got dtype {recorded.dtype}")
    _check_k(k)
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be an int >= 0, got {length!r}")
    if recorded.dim() == 0 or recorded.shape[-1] != k:
        raise ValueError(f"recorded must have shape [..., k={k}], got {tuple(recorded.shape)}")
    if batch_shape is not None and tuple(recorded.shape[:-1]) != tuple(batch_shape):
        raise ValueError(
            f"recorded batch shape {tuple(recorded.shape[:-1])} != expected {tuple(batch_shape)}"
        )
    idx = recorded.to(device=device if device is not None else recorded.device, dtype=torch.long)
    if idx.numel() == 0:
        return idx.clone()
    lo, hi = int(idx.min()), int(idx.max())
    if lo < -1 or hi >= length:
        raise ValueError(f"recorded indices must lie in [-1, {length}), found range [{lo}, {hi}]")

    key = torch.where(idx < 0, torch.full_like(idx, length), idx)  # -1 sorts last
    if canonicalize:
        key, _ = torch.sort(key, dim=-1)
    diffs = key[..., 1:] - key[..., :-1]
    valid_next = key[..., 1:] < length
    if bool((valid_next & (diffs == 0)).any()):
        raise ValueError("recorded indices contain a duplicate index within a row")
    if bool((diffs < 0).any()):
        raise ValueError(
            "recorded rows are not canonical (ascending valid indices, -1 padding at the end); "
            "pass canonicalize=True to sort them"
        )
    return torch.where(key == length, torch.full_like(key, -1), key)


"""Shared helpers of the GLM-5 ops: the compute dtype and the query blocks that bound peak memory."""

from __future__ import annotations

from collections.abc import Iterator

import torch

#: Elements of the largest intermediate one query block may hold (2**24 float32 = 64 MiB).
MAX_BLOCK_ELEMENTS = 1 << 24


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any input is float64 (gradient checks), else float32 (the kernels' accumulator)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def query_blocks(n_queries: int, elements_per_query: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` ranges covering ``range(n_queries)``, each holding at most ``MAX_BLOCK_ELEMENTS``
    elements of a per-query intermediate of ``elements_per_query`` (at least one query a block)."""
    step = max(1, MAX_BLOCK_ELEMENTS // max(1, elements_per_query))
    for start in range(0, n_queries, step):
        yield start, min(start + step, n_queries)


def check_shape(name: str, tensor: torch.Tensor, shape: tuple[int | None, ...], fix: str) -> None:
    """One-line ``ValueError`` naming ``name`` unless ``tensor`` has ``shape`` (``None`` = any size)."""
    if tensor.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, tensor.shape)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected [{want}]: {fix}")


def valid_indices(indices: torch.Tensor, n_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid, safe)``: which entries of an index tensor name a key (``0 <= i < n_keys``; ``-1`` pads),
    and the indices as int64 with invalid entries replaced by 0 (safe to gather)."""
    idx = indices.long()
    valid = (idx >= 0) & (idx < n_keys)
    return valid, torch.where(valid, idx, torch.zeros_like(idx))

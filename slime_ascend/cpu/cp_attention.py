"""Causal attention of a THD-packed batch split over context-parallel (CP) ranks, as pure functions.

slime packs a micro-batch into one token stream with segment boundaries ``cu_seqlens`` and splits it over
the CP group in one of two layouts (``slime/backends/megatron_utils/data.py``, ``get_batch``):

* ``zigzag`` (default): every segment is padded to ``2 * cp_size`` equal chunks and rank r holds chunks r
  and ``2 * cp_size - 1 - r`` of each, in segment order (``cp_utils.slice_with_cp``); ``cu_seqlens`` are
  the global (un-split) boundaries, i.e. ``cp_size`` times the local ones;
* ``allgather`` (``--allgather-cp``): the whole stream is concatenated, padded to a multiple of
  ``cp_size`` and cut into ``cp_size`` contiguous pieces, rank r holding piece r; ``cu_seqlens`` are the
  boundaries in the global stream, and a segment may straddle ranks.

Each rank attends its own queries to the keys and values of every rank (one all-gather, passed in as a
callable so that its backward, a reduce-scatter, stays the caller's), causally by global position within
each segment: the result equals causal attention on the un-split stream, then split. Tokens past
``cu_seqlens[-1]`` get zeros. :func:`global_positions` also gives the RoPE position of every local token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["LAYOUTS", "cp_causal_attention", "global_positions", "stream_order"]

LAYOUTS = ("zigzag", "allgather")
AllGather = Callable[[torch.Tensor], list[torch.Tensor]]


def _bounds(cu_seqlens: torch.Tensor | list[int]) -> list[int]:
    return [int(b) for b in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]


def _check(layout: str, local_tokens: int, bounds: list[int], cp_rank: int, cp_size: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"need 0 <= cp_rank < cp_size, got cp_rank={cp_rank}, cp_size={cp_size}")
    if bounds[-1] > local_tokens * cp_size:
        raise ValueError(f"cu_seqlens end at {bounds[-1]}, past the {local_tokens} x {cp_size} tokens of the CP group")
    if layout == "zigzag" and cp_size > 1:
        odd = [e - s for s, e in zip(bounds[:-1], bounds[1:]) if (e - s) % (2 * cp_size)]
        if odd:
            raise ValueError(f"zigzag CP needs every segment length divisible by 2 * cp_size = {2 * cp_size}, "
                             f"got {odd} (slime pads each sequence to that)")


def stream_order(layout: str, cu_seqlens, local_tokens: int, cp_size: int) -> torch.Tensor:
    """For each global stream position below ``cu_seqlens[-1]``, its index in the rank-major concatenation of
    the CP ranks' local streams (``torch.cat(all_gather(local))``)."""
    bounds = _bounds(cu_seqlens)
    _check(layout, local_tokens, bounds, 0, cp_size)
    if layout == "allgather" or cp_size == 1:
        return torch.arange(bounds[-1])
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk, local_start = (end - start) // (2 * cp_size), start // cp_size
        for j in range(2 * cp_size):
            rank, second = (j, 0) if j < cp_size else (2 * cp_size - 1 - j, 1)
            first = rank * local_tokens + local_start + second * chunk
            parts.append(torch.arange(first, first + chunk))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def global_positions(layout: str, cu_seqlens, local_tokens: int, cp_rank: int,
                     cp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(segment, position)`` of each of this rank's ``local_tokens``: its segment index and its position in
    that segment (the RoPE position), both -1 past ``cu_seqlens[-1]``."""
    bounds = _bounds(cu_seqlens)
    _check(layout, local_tokens, bounds, cp_rank, cp_size)
    order = stream_order(layout, bounds, local_tokens, cp_size)
    stream = torch.full((local_tokens * cp_size,), -1, dtype=torch.long)
    stream[order] = torch.arange(order.numel())  # concatenated index -> global stream position
    mine = stream[cp_rank * local_tokens:(cp_rank + 1) * local_tokens]
    edges = torch.tensor(bounds)
    segment = torch.searchsorted(edges, mine, right=True) - 1
    position = mine - edges[segment.clamp(min=0, max=len(bounds) - 1)]
    valid = mine >= 0
    return torch.where(valid, segment, -1), torch.where(valid, position, -1)


def cp_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens, *,
                        layout: str, cp_rank: int, cp_size: int, all_gather: AllGather | None,
                        scale: float | None = None) -> torch.Tensor:
    """This rank's causal attention output ``[t, heads, dim]``.

    ``query`` is ``[t, heads, dim]``, ``key``/``value`` ``[t, kv_heads, dim]`` (this rank's ``t`` tokens;
    grouped-query heads are repeated); ``cu_seqlens`` the global segment boundaries; ``all_gather(x)`` returns
    every CP rank's equally shaped ``x`` in rank order (unused for ``cp_size == 1``).
    """
    t, heads, _ = query.shape
    bounds = _bounds(cu_seqlens)
    _check(layout, t, bounds, cp_rank, cp_size)
    if cp_size > 1:
        if all_gather is None:
            raise ValueError("cp_size > 1 needs an all_gather callable")
        kv = torch.cat(all_gather(torch.cat([key, value], dim=1)), dim=0)[stream_order(layout, bounds, t, cp_size)]
        key, value = kv.split(key.shape[1], dim=1)
    groups = heads // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    segment, position = global_positions(layout, bounds, t, cp_rank, cp_size)
    out = torch.zeros_like(query)
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        rows = (segment == i).nonzero().flatten()
        if rows.numel() == 0:
            continue
        q = query[rows].transpose(0, 1)  # [heads, rows, dim]
        k, v = (x[start:end].transpose(0, 1) for x in (key, value))
        mask = torch.arange(end - start)[None, :] <= position[rows][:, None]  # causal by global position
        out[rows] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)
    return out

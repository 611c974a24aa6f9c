"""RoPE on packed (``thd``) sequences in plain torch: apex's ``fused_apply_rotary_pos_emb_thd``.

slime's GLM-5 spec (``slime_plugins/models/glm5/glm5.py:876``, inside ``fuse_rope``) imports
``apex.transformer.functional.fused_apply_rotary_pos_emb_thd`` (``apex/transformer/functional/fused_rope.py``,
``fused_apply_rotary_pos_emb_thd(t, cu_seqlens, freqs)``) and calls it with three positional arguments, after
de-interleaving the MLA rope dims itself (``cat(x[..., 0::2], x[..., 1::2])``). The kernel's semantics
(``csrc/megatron/fused_rotary_positional_embedding.h``, ``fused_rope_thd_forward``):

* ``t`` [T, H, D]; ``cu_seqlens`` [b + 1]; ``freqs`` [max_s, 1, 1, d2] float, ``d2 <= D`` even;
* token ``t_id`` of sequence ``b`` has position ``s = t_id - cu_seqlens[b]`` and uses ``freqs[s]``;
* on the first ``d2`` dims ``out = x * cos(f) + rotate_half(x) * sin(f)``, ``rotate_half(x) = [-x2, x1]``
  (halves), with ``cos`` / ``sin`` computed in float and cast to ``t``'s dtype before the products (as the
  kernel does); dims ``d2:`` are copied; the backward is the transpose (torch autograd here).

Beyond apex, with defaults that keep its behaviour (Megatron's TE wrapper has the same extra arguments,
``megatron/core/extensions/transformer_engine.py`` ``fused_apply_rotary_pos_emb_thd``):

* ``interleaved=True`` rotates adjacent pairs ``(x[2i], x[2i+1])`` instead of halves (Megatron's
  ``rotary_interleaved``; ``freqs`` then in that layout, ``[f0, f0, f1, f1, ...]``);
* ``cp_size`` / ``cp_rank``: ``t`` holds this context-parallel rank's share of every sequence (Megatron's
  load-balanced split: chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size``), while
  ``cu_seqlens`` are the full sequences' (each length divisible by ``2 * cp_size``).

Where the kernel leaves memory unwritten (tokens after ``cu_seqlens[-1]``) the input is copied; a position
at or beyond ``max_s`` raises ``ValueError`` (the kernel never writes it).
"""

from __future__ import annotations

import torch

from ._blocks import check_shape

__all__ = ["fused_apply_rotary_pos_emb_thd"]


def _positions(cu_seqlens: torch.Tensor, n_tokens: int, cp_size: int, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pos, inside)`` per local token: its position in its full sequence, and whether a sequence holds it."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    if cp_size > 1 and bool((lengths % (2 * cp_size) != 0).any()):
        raise ValueError(f"every sequence length in cu_seqlens must be divisible by 2 * cp_size = {2 * cp_size}")
    local_cu = torch.cat([cu[:1] * 0, torch.cumsum(lengths // cp_size, 0)])
    token = torch.arange(n_tokens, device=cu.device)
    seq = (torch.searchsorted(local_cu[1:].contiguous(), token, right=True)).clamp(max=max(len(lengths) - 1, 0))
    inside = token < local_cu[-1]
    u = token - local_cu[seq]  # index within this rank's share of the sequence
    if cp_size == 1:
        return u, inside
    half = lengths[seq] // (2 * cp_size)
    first = u < half
    pos = torch.where(first, cp_rank * half + u, lengths[seq] - (cp_rank + 1) * half + (u - half))
    return pos, inside


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def fused_apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_size=1, cp_rank=0, interleaved=False):
    """``t`` [T, H, D] with RoPE applied per packed sequence (positions restart at every ``cu_seqlens``)."""
    check_shape("t", t, (None, None, None), "t is [tokens, heads, dim] (thd)")
    check_shape("cu_seqlens", cu_seqlens, (None,), "cu_seqlens is [b + 1], starting at 0")
    check_shape("freqs", freqs, (None, 1, 1, None), "freqs is [max_s, 1, 1, rotary_dim]")
    max_s, d2 = freqs.shape[0], freqs.shape[-1]
    if d2 % 2 or d2 > t.shape[-1] or not freqs.is_floating_point():
        raise ValueError(f"freqs' rotary dim {d2} must be even, float and at most t's dim {t.shape[-1]}")
    if not (isinstance(cp_size, int) and cp_size >= 1 and isinstance(cp_rank, int) and 0 <= cp_rank < cp_size):
        raise ValueError(f"cp_size={cp_size!r}, cp_rank={cp_rank!r}: need ints with 0 <= cp_rank < cp_size")
    pos, inside = _positions(cu_seqlens, t.shape[0], cp_size, cp_rank)
    if bool((inside & (pos >= max_s)).any()):
        raise ValueError(f"a sequence in cu_seqlens is longer than freqs' max_s = {max_s}: pass longer freqs")
    f = freqs.reshape(max_s, d2)[pos.clamp(0, max(max_s - 1, 0))][:, None, :]  # [T, 1, d2]
    x, rest = t[..., :d2], t[..., d2:]
    rotated = x * torch.cos(f).to(t.dtype) + _rotate(x, interleaved) * torch.sin(f).to(t.dtype)
    return torch.cat((torch.where(inside[:, None, None], rotated, x), rest), dim=-1)

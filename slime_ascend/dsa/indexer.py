"""The deterministic counterpart of slime's ``pytorch_topk_with_invalid_padding`` (its output contract).

slime (``slime_plugins/models/glm5/ops/indexer.py``)::

    selected = min(topk, logits.shape[-1])
    scores, indices = torch.topk(logits, selected, dim=-1)
    indices = indices.to(torch.int32)
    indices = indices.masked_fill(scores == -torch.inf, -1)
    # then pads scores with -inf and indices with -1 up to width topk

:func:`topk_with_invalid_padding` returns the same tensors (shape ``[..., topk]``, scores in the dtype
of ``logits`` best first, int32 indices, ``-1`` for ``-inf`` keys and for padding, ``-inf`` padding
scores), with one difference: among equal scores the lower index comes first and is the one kept at
the k-th place, on every device and call. NaN logits are refused (``ValueError``) where ``torch.topk``
would select them as the largest keys.
"""

from __future__ import annotations

import torch

from ..algorithms.dsa_topk import deterministic_topk


def topk_with_invalid_padding(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores, indices)`` [..., topk] of the deterministic top-k of ``logits`` [..., L], in slime's layout."""
    return deterministic_topk(logits, int(topk), index_dtype=torch.int32)

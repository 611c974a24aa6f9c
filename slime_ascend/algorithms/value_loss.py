"""PPO critic loss with value clipping (same per-token semantics as slime's ``value_loss_function``)."""

from __future__ import annotations

import torch

__all__ = ["clipped_value_loss"]


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss and clip indicator.

    ``loss = max((old + clamp(values - old, -c, c) - returns)**2, (values - returns)**2)`` and
    ``clipfrac = float(|values - old| > c)``. Reduce both with the same masked mean (slime uses its
    ``sum_of_sample_mean`` reducer); see :func:`~slime_ascend.algorithms.masks.token_mean`.
    """
    if not (values.shape == old_values.shape == returns.shape):
        raise ValueError(
            "values, old_values and returns must have the same shape; got "
            f"{tuple(values.shape)}, {tuple(old_values.shape)}, {tuple(returns.shape)}"
        )
    if not value_clip >= 0:
        raise ValueError(f"value_clip must be >= 0, got {value_clip}")
    diff = values - old_values
    clipped = old_values + diff.clamp(-value_clip, value_clip)
    loss = torch.maximum((clipped - returns) ** 2, (values - returns) ** 2)
    clipfrac = (diff.abs() > value_clip).to(values.dtype)
    return loss, clipfrac


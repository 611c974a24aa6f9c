"""PPO critic loss with value clipping (same per-token semantics as slime's ``value_loss_function``)."""

from __future__ import annotations

import torch

__all__ = ["clipped_value_loss", "masked_token_mean"]


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss and clip indicator.

    ``loss = max((old + clamp(values - old, -c, c) - returns)**2, (values - returns)**2)`` and
    ``clipfrac = float(|values - old| > c)``. Reduce both with the same masked mean (slime uses its
    ``sum_of_sample_mean`` reducer); see :func:`masked_token_mean`.
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


def masked_token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(x * mask) / max(sum(mask), 1)`` (0 for an all-zero mask)."""
    if x.shape != mask.shape:
        raise ValueError(f"x and mask must have the same shape; got {tuple(x.shape)} and {tuple(mask.shape)}")
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1)

"""SAO losses for slime's custom-loss hook: DIS policy loss (actor) and clipped value loss (critic).

Actor (``args.loss_type == "custom_loss"``): DIS, ``-sg[f(r)] * A * log pi_theta`` with
``r = exp(log pi_theta - log pi_rollout)`` and the engine's log-probs as behaviour policy (no pi_old),
``f(r) = r`` inside the open band ``(1 - eps_low, 1 + eps_high)`` and 0 outside
(:func:`slime_ascend.algorithms.masks.dis_policy_loss`).

Critic (slime sets ``loss_type = "value_loss"``; the ``train.critic_advantage_function`` patch routes
that call here): :func:`slime_ascend.algorithms.value_loss.clipped_value_loss` against the returns of
the skip-observation GAE, clipped relative to the pre-update values with ``--value-clip``.

The actor's train-side log-probs are handed to slime's dump (``--save-debug-train-data``) as slime's own policy
loss hands them (:func:`capture_train_log_probs`): with ``use_rollout_logprobs`` slime skips their separate
forward and snapshots them in the loss, which sao's takes the place of.

Both are reduced with slime's ``sum_of_sample_mean`` argument. The sao YAML sets
``calculate_per_token_loss: true``, which makes that a token sum and makes slime/Megatron divide by
the step's trainable-token count: the loss is the mean over all trainable tokens of the step
(SAO / GLM-5.2 token-level normalisation). Metrics go through the same reducer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from slime_ascend.algorithms.cp import cp_slice
from slime_ascend.algorithms.masks import DISBand, dis_policy_loss, dis_ratio, resolve_dis_band
from slime_ascend.algorithms.value_loss import clipped_value_loss
from slime_ascend.megatron_state import cp_state

__all__ = ["capture_train_log_probs", "dis_band", "dis_loss", "local_loss_masks", "sao_loss", "value_loss"]

PLUGIN_NAME = "sao"
Reducer = Callable[[torch.Tensor], torch.Tensor]


def dis_band(settings: Any) -> DISBand:
    """The DIS band of the sao settings (preset, or the two custom eps)."""
    return resolve_dis_band(settings.dis_preset, settings.dis_eps_low, settings.dis_eps_high, "ascend_sao_dis_")


def local_loss_masks(loss_masks: Sequence[torch.Tensor], total_lengths: Sequence[int],
                     response_lengths: Sequence[int], cp_rank: int, cp_size: int) -> list[torch.Tensor]:
    """Full-length loss masks -> this CP rank's zig-zag pieces (identity for cp_size 1)."""
    if cp_size == 1:
        return list(loss_masks)
    return [cp_slice(m, cp_rank, cp_size, t, r) for m, t, r in zip(loss_masks, total_lengths, response_lengths,
                                                                    strict=True)]


def dis_loss(
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    local_mask: torch.Tensor,
    reducer: Reducer,
    band: DISBand,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DIS loss on flat CP-local tensors, reduced with ``reducer``; metrics reduced the same way."""
    per_token, keep, _ = dis_policy_loss(train_log_probs, rollout_log_probs, advantages, local_mask, *band)
    loss = reducer(per_token)
    r = dis_ratio(train_log_probs, rollout_log_probs).to(per_token.dtype)
    trainable = local_mask.bool()
    f = per_token.dtype
    metrics = {
        "pg_loss": loss.detach(),
        "dis_masked_frac": reducer((trainable & ~keep).to(f)).detach(),
        "dis_low_frac": reducer((r <= 1.0 - band.eps_low).to(f)).detach(),
        "dis_high_frac": reducer((r >= 1.0 + band.eps_high).to(f)).detach(),
        "dis_ratio_mean": reducer(torch.nan_to_num(r, nan=0.0, posinf=0.0)).detach(),
        "train_rollout_logprob_abs_diff": reducer((train_log_probs.detach() - rollout_log_probs).abs()).detach(),
    }
    return loss, metrics


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, reducer: Reducer, value_clip: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss on flat CP-local tensors, reduced with ``reducer``."""
    per_token, clipped = clipped_value_loss(values, old_values.to(values.dtype), returns.to(values.dtype), value_clip)
    loss = reducer(per_token)
    return loss, {"value_loss": loss.detach(), "value_clipfrac": reducer(clipped).detach()}


def capture_train_log_probs(batch: dict, log_probs: Sequence[torch.Tensor]) -> None:
    """This micro-batch's per-sample (CP-local) train-side log-probs into slime's dump capture, as slime's
    ``policy_loss_function`` puts them (``loss._maybe_capture_log_probs``: a no-op unless slime dumps train data
    and skipped their separate forward; the first value of each sample wins, i.e. the pre-update one). A slime
    without that capture is left alone: its dump then has no train-side log-probs with sao."""
    from slime.backends.megatron_utils import loss as slime_loss

    capture = getattr(slime_loss, "_maybe_capture_log_probs", None)
    if capture is not None:
        capture(batch, list(log_probs))


def sao_loss(args: Any, batch: dict, logits: torch.Tensor, sum_of_sample_mean: Reducer) -> tuple[torch.Tensor, dict]:
    """slime custom loss: value loss in the critic (``loss_type == "value_loss"``), DIS in the actor."""
    from slime.backends.megatron_utils.loss import get_log_probs_and_entropy, get_values

    from slime_ascend.plugins import runtime

    settings = runtime.settings(args, PLUGIN_NAME)
    common = dict(args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
                  response_lengths=batch["response_lengths"])
    if getattr(args, "loss_type", None) == "value_loss":
        _, out = get_values(logits, **common)
        values = torch.cat([v.flatten() for v in out["values"]], dim=0)
        loss, metrics = value_loss(values, torch.cat(batch["values"], dim=0), torch.cat(batch["returns"], dim=0),
                                   sum_of_sample_mean, float(args.value_clip))
        if values.numel() == 0:
            loss = loss + 0 * values.sum()
        return loss, metrics

    if batch.get("rollout_log_probs") is None:
        raise ValueError(
            "sao: the loss batch has no rollout_log_probs (DIS needs the engine's log-probs). Fix: use a rollout "
            "that records Sample.rollout_log_probs (slime's sglang rollout does)"
        )
    _, out = get_log_probs_and_entropy(logits, with_entropy=False, **common)
    capture_train_log_probs(batch, out["log_probs"])
    train_lp = torch.cat(out["log_probs"], dim=0)
    rollout_lp = torch.cat(batch["rollout_log_probs"], dim=0).to(train_lp.device)
    advantages = torch.cat(batch["advantages"], dim=0).to(train_lp.device)
    cp_rank, cp_size, _ = cp_state()
    masks = local_loss_masks(batch["loss_masks"], batch["total_lengths"], batch["response_lengths"], cp_rank, cp_size)
    mask = torch.cat(masks, dim=0).to(train_lp.device) if masks else torch.zeros_like(train_lp)
    loss, metrics = dis_loss(train_lp, rollout_lp, advantages, mask, sum_of_sample_mean, dis_band(settings))
    if train_lp.numel() == 0:
        loss = loss + 0 * logits.sum()
    return loss, {"loss": loss.detach(), **metrics}

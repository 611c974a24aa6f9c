"""Train/rollout importance masks: DIS (GLM-5 / SAO) and IcePop (Ring-1T / GLM-5).

Both act on per-token log-probabilities of the *sampled* tokens, given as same-shaped tensors (one
flat tensor of concatenated samples, or [B, T]). Ratios are computed in fp32 (fp64 inputs stay fp64).
A NaN ratio is never inside a band, so such tokens are masked out.

DIS (GLM-5 report; DESIGN.md "Numerical conventions"):
    r = exp(logp_train - logp_rollout), with logp_train at the *current* parameters (with grad) and
    logp_rollout recorded by the inference engine; no separate pi_old.
    f(r) = r if 1 - eps_low < r < 1 + eps_high (strict, open band), else 0.
    per-token loss = -sg[f(r)] * A * logp_train, so the gradient inside the band is r*A*grad(logp)
    = A*grad(r) (an unclipped IS surrogate) and exactly zero outside it whatever the sign of A.
    The batch loss is the mean over all *trainable* tokens (loss_mask), masked-out tokens included in
    the denominator (:func:`token_mean`).

IcePop (GLM-5 report, Ring-1T; DESIGN.md "Numerical conventions"):
    rho = exp(logp_train_old - logp_rollout), both at the old parameters (the trainer's recompute vs
    the engine). M(rho) = rho if low <= rho <= high (inclusive), else 0; default band [1/beta, beta],
    beta = 2 (GLM-5). The weight multiplies the per-token PPO loss. ``reweight=False`` gives the pure
    0/1 mask variant (a different estimator).

Differences from slime's ``icepop_function`` (``slime/backends/megatron_utils/loss.py`` ~l.908):
    * slime's band is ``[--tis-clip-low, --tis-clip]`` with defaults ``[0, 2]``, i.e. no lower cut
      unless ``--tis-clip-low 0.5`` is passed; ours defaults to ``[1/beta, beta] = [0.5, 2]``.
    * slime takes lists of per-sample tensors and concatenates; ours takes any same-shaped tensors.
    * slime computes in the input dtype and does not detach the weight (its inputs carry no grad);
      ours computes in fp32 and returns detached weights.
    * slime's ``tis_clipfrac`` is ``weight != ratio`` over all tokens (NaN counts as clipped, and a
      ratio of exactly 0 inside the band would not); ours returns the keep mask and leaves the
      loss-mask-aware fraction to :mod:`slime_ascend.algorithms.mismatch`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = [
    "DISBand",
    "DIS_PRESETS",
    "resolve_dis_band",
    "log_ratio",
    "dis_ratio",
    "dis_mask",
    "dis_policy_loss",
    "icepop_weights",
    "token_mean",
]


class DISBand(NamedTuple):
    """DIS band parameters: keep 1 - eps_low < r < 1 + eps_high."""

    eps_low: float
    eps_high: float


#: DIS presets. ``maths`` and ``coding`` are SAO §4.1 (maths/TIR band (0.7, 6.0), coding band
#: (0.2, 4.0); the reference README swaps in 0.8/3.0 for maths, its script uses 0.3/5.0).
#: ``glm5``: the GLM-5 report gives no numeric DIS epsilon; (0.2, 0.28) is the GLM-5 reasoning-RL
#: clip pair (eps_low, eps_high), used here as a conservative band (0.8, 1.28). It is our choice [D],
#: not a published DIS setting.
DIS_PRESETS: dict[str, DISBand] = {
    "glm5": DISBand(0.2, 0.28),
    "maths": DISBand(0.3, 5.0),
    "coding": DISBand(0.8, 3.0),
}


def resolve_dis_band(preset: str, eps_low: float | None, eps_high: float | None, key_prefix: str) -> DISBand:
    """The band a DIS configuration names: a preset, or ``custom`` with both eps (> 0, finite).

    ``key_prefix`` is the settings prefix the user wrote (``ascend_dis_``, ``ascend_sao_dis_``); the errors
    name those keys. Eps set together with a named preset is an error too (it would be ignored).
    """
    if preset == "custom":
        for name, value in (("eps_low", eps_low), ("eps_high", eps_high)):
            if value is None or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"{key_prefix}preset is 'custom' but {key_prefix}{name}={value!r}. Fix: set {key_prefix}{name} "
                    "to a number > 0 in the YAML"
                )
        return DISBand(float(eps_low), float(eps_high))
    if preset not in DIS_PRESETS:
        raise ValueError(f"{key_prefix}preset={preset!r}; use one of {sorted(DIS_PRESETS)} or 'custom'")
    if eps_low is not None or eps_high is not None:
        raise ValueError(
            f"{key_prefix}eps_low/eps_high are set but {key_prefix}preset={preset!r} defines the band "
            f"{tuple(DIS_PRESETS[preset])}. Fix: set the preset to custom ({key_prefix}preset: custom) to use "
            "your own band, or remove the eps settings"
        )
    return DIS_PRESETS[preset]


def _check_pair(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> None:
    for name, t in ((name_a, a), (name_b, b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a float tensor of log-probs, got dtype {t.dtype}")
    if a.shape != b.shape:
        raise ValueError(f"{name_a} {tuple(a.shape)} and {name_b} {tuple(b.shape)} must have the same shape")


def _check_eps(eps_low: float, eps_high: float) -> None:
    for name, v in (("eps_low", eps_low), ("eps_high", eps_high)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")


def log_ratio(num_logp: torch.Tensor, den_logp: torch.Tensor) -> torch.Tensor:
    """Detached num_logp - den_logp, fp32 (fp64 if an input is fp64)."""
    dtype = torch.float64 if torch.float64 in (num_logp.dtype, den_logp.dtype) else torch.float32
    return num_logp.detach().to(dtype) - den_logp.detach().to(dtype)


def dis_ratio(train_logp: torch.Tensor, rollout_logp: torch.Tensor) -> torch.Tensor:
    """Detached r = exp(train_logp - rollout_logp), fp32 (fp64 if an input is fp64)."""
    _check_pair(train_logp, rollout_logp, "train_logp", "rollout_logp")
    return torch.exp(log_ratio(train_logp, rollout_logp))


def in_dis_band(r: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """Bool tensor: True where 1 - eps_low < r < 1 + eps_high (the strict open band; NaN is outside)."""
    return (r > 1.0 - eps_low) & (r < 1.0 + eps_high)


def dis_mask(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, eps_low: float, eps_high: float
) -> torch.Tensor:
    """Bool tensor: True where 1 - eps_low < exp(train_logp - rollout_logp) < 1 + eps_high (strict)."""
    _check_eps(eps_low, eps_high)
    return in_dis_band(dis_ratio(train_logp, rollout_logp), eps_low, eps_high)


def token_mean(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Σ(values·mask) / max(Σ mask, 1): the mean over all trainable tokens (SAO/GLM-5.2 normalisation).

    Masked-out positions contribute 0 even if ``values`` is NaN/inf there.
    """
    if values.shape != loss_mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and loss_mask {tuple(loss_mask.shape)} must match")
    m = loss_mask.bool()
    total = torch.where(m, values, torch.zeros_like(values)).sum()
    return total / m.sum().clamp(min=1).to(total.dtype)


def dis_policy_loss(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """DIS per-token loss -sg[f(r)]·A·logp_train (see module docstring).

    Args:
        train_logp: log-probs at the current parameters (carries grad), any shape.
        rollout_logp: engine log-probs, same shape.
        advantages: same shape (broadcast a per-sample advantage before calling).
        loss_mask: same shape, bool or 0/1; trainable tokens.
        eps_low, eps_high: band parameters (> 0), e.g. ``DIS_PRESETS["maths"]``.

    Returns:
        per_token_loss: same shape and dtype as ``train_logp``; exactly 0 where not kept. Reduce with
            :func:`token_mean` (denominator = trainable tokens) or the caller's reducer.
        keep_mask: bool, loss_mask & inside band.
        metrics: detached 0-d tensors: ``dis_trainable_tokens``, ``dis_kept_tokens``,
            ``dis_masked_frac`` (trainable tokens outside the band / trainable tokens),
            ``dis_low_frac`` (r <= 1-eps_low), ``dis_high_frac`` (r >= 1+eps_high; NaN counts in
            neither low nor high but is masked), ``dis_ratio_mean`` (mean r over trainable tokens).
    """
    _check_pair(train_logp, rollout_logp, "train_logp", "rollout_logp")
    for name, t in (("advantages", advantages), ("loss_mask", loss_mask)):
        if not isinstance(t, torch.Tensor) or t.shape != train_logp.shape:
            raise ValueError(f"{name} must be a tensor of shape {tuple(train_logp.shape)}")
    _check_eps(eps_low, eps_high)
    r = torch.exp(log_ratio(train_logp, rollout_logp))
    in_band = in_dis_band(r, eps_low, eps_high)
    trainable = loss_mask.bool()
    keep = trainable & in_band
    weight = torch.where(keep, r, torch.zeros_like(r)).to(train_logp.dtype)
    adv = advantages.detach().to(train_logp.dtype)
    adv = torch.where(keep, adv, torch.zeros_like(adv))  # no NaN/inf leaks through masked tokens
    zero = torch.zeros((), dtype=train_logp.dtype, device=train_logp.device)
    per_token = torch.where(keep, -(weight * adv) * train_logp, zero)

    n = trainable.sum()
    denom = n.clamp(min=1).to(torch.float32)
    low = trainable & (r <= 1.0 - eps_low)
    high = trainable & (r >= 1.0 + eps_high)
    metrics = {
        "dis_trainable_tokens": n.detach(),
        "dis_kept_tokens": keep.sum().detach(),
        "dis_masked_frac": ((trainable & ~in_band).sum() / denom).detach(),
        "dis_low_frac": (low.sum() / denom).detach(),
        "dis_high_frac": (high.sum() / denom).detach(),
        "dis_ratio_mean": (torch.where(trainable, r, torch.zeros_like(r)).sum() / denom).detach(),
    }
    return per_token, keep, metrics


def icepop_weights(
    old_train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    beta: float = 2.0,
    *,
    low: float | None = None,
    reweight: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """IcePop weights M(rho), rho = exp(old_train_logp - rollout_logp), band [low, beta] inclusive.

    Args:
        old_train_logp: trainer log-probs at the old parameters (recomputed before the update).
        rollout_logp: engine log-probs, same shape.
        beta: upper bound (> 1); ``low`` defaults to 1/beta (Ring-1T used low=0.5, beta=5).
        reweight: True (default, IcePop/slime): weight = rho inside the band; False: weight = 1.

    Returns:
        (weights, keep_mask): detached fp32 weights (fp64 if an input is fp64), 0 outside the band;
        bool keep mask. Multiply the weights into the per-token PPO loss.
    """
    _check_pair(old_train_logp, rollout_logp, "old_train_logp", "rollout_logp")
    if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not math.isfinite(beta) or beta <= 1:
        raise ValueError(f"beta must be a finite number > 1, got {beta!r}")
    lo = 1.0 / beta if low is None else low
    if not isinstance(lo, (int, float)) or not math.isfinite(lo) or lo < 0 or lo > beta:
        raise ValueError(f"low must be a finite number in [0, beta={beta}], got {low!r}")
    rho = torch.exp(log_ratio(old_train_logp, rollout_logp))
    keep = (rho >= lo) & (rho <= beta)
    inside = rho if reweight else torch.ones_like(rho)
    return torch.where(keep, inside, torch.zeros_like(rho)), keep

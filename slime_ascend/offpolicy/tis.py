"""The train side of off-policy control: ``dis`` and ``icepop`` as contributions to slime's TIS hook
(``--custom-tis-function-path``), in the train actor (declared in :mod:`slime_ascend.offpolicy.plugin`).

What slime passes (``policy_loss_function``, slime/backends/megatron_utils/loss.py): ``pg_loss`` is the
per-token PPO loss of this CP rank's tokens (flat, samples concatenated); ``train_log_probs`` are the
trainer's *old* log-probs (``batch["log_probs"]``, recomputed before the update; the detached current
ones when slime skipped the recompute, which it does only when they are equal); ``rollout_log_probs``
are the engine's; both are lists of CP-local per-sample tensors. ``loss_masks`` are full length per
sample. slime multiplies nothing else in: it rebuilds the loss reducer from the masks we return,
keeping the pre-TIS per-rollout denominators (``rollout_mask_sums``), and reduces every metric (a flat
per-token tensor like ``pg_loss``) with the *original* masks.

DIS (order 100). w = exp(logp_old - logp_rollout); keep = 1 - eps_low < w < 1 + eps_high (strict).
Outside the band the token's PPO loss is zeroed and its loss mask cleared, so entropy / KL / clip-frac
skip it too while the denominators stay the pre-mask token counts (SAO: masked tokens still count in
the token mean). Inside the band the loss is multiplied by w (``ascend_dis_weight: ratio``) or by 1
(``mask``). Equivalence with the paper's -sg[f(r)]·A·logπθ, r = πθ/π_rollout: where PPO's clip is
inactive, the PPO loss -(πθ/π_old)·A has gradient -(πθ/π_old)·A·∇logπθ, and times w that is
-r·A·∇logπθ, exactly the paper's gradient. The band is tested on w (π_old) instead of r (πθ); the two
are equal at θ = θ_old, i.e. on the first optimizer step on a batch, where PPO's clip is also inactive.
So at that step the gradient equals :func:`~slime_ascend.algorithms.masks.dis_policy_loss`'s (tested);
the loss *value* differs (-r·A versus -r·A·logπθ). For pure DIS at later steps too, widen PPO's clip
(``--eps-clip``), since DIS is not PPO clipping.

IcePop (order 200). ρ = w, weight M(ρ) = ρ on [low, beta] (inclusive), else 0, multiplied into the PPO
loss; masks returned unchanged (IcePop's 1/|y| keeps masked tokens in the denominator). Equal to
slime's ``icepop_function`` with ``--tis-clip beta --tis-clip-low low``.

Metrics (flat per-token, this rank's tokens, so slime's reducer averages them over trainable tokens):
``<p>_masked`` (1 outside the band), ``<p>_ratio`` (w, with log w clamped to ±20), ``<p>_k3_kl``
(exp(Δ)-1-Δ, Δ = log w clamped to ±20: the k3 estimate of KL(π_rollout‖π_old)), ``<p>_logratio_abs``
(|Δ|); DIS adds ``dis_low`` / ``dis_high`` (below / above the band). Non-finite Δ counts as masked
with 0 in the other metrics.

Context parallelism: everything per token is computed on the local tokens. Only the returned
full-length masks need the other ranks' decisions: each rank writes its kept flags at its zig-zag
positions of a zero buffer over the whole micro-batch, and one all-reduce (SUM) over the CP group
completes it (the pattern of slime's ``mis.py``, with one collective per call instead of one per
sample).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from ..algorithms.cp import cp_local_length, cp_response_ranges
from ..algorithms.masks import icepop_weights, in_dis_band, log_ratio, resolve_dis_band
from ..algorithms.mismatch import SAFETY_BOUND
from ..plugins.settings import SettingsError

__all__ = [
    "CPContext",
    "cp_context",
    "dis_band",
    "dis_tis",
    "icepop_tis",
    "full_keep_masks",
    "validate_dis",
    "validate_icepop",
]

TIS_DISPATCHER = "slime_ascend.hooks.tis_function"


# ---- context parallel ------------------------------------------------------------------------------
class CPContext:
    """This process's CP rank, size and process group (size 1: no CP)."""

    __slots__ = ("rank", "size", "group")

    def __init__(self, rank: int = 0, size: int = 1, group: Any = None):
        self.rank, self.size, self.group = rank, size, group


def cp_context() -> CPContext:
    """Megatron's CP state; no CP when Megatron is not loaded or its parallel state is not initialised.

    Megatron is not imported here: a process that never imported it has no parallel state.
    """
    core = sys.modules.get("megatron.core")
    mpu = getattr(core, "mpu", None) or sys.modules.get("megatron.core.parallel_state")
    if mpu is None:
        return CPContext()
    try:
        size = int(mpu.get_context_parallel_world_size())
        if size <= 1:
            return CPContext()
        return CPContext(int(mpu.get_context_parallel_rank()), size, mpu.get_context_parallel_group())
    except (AssertionError, AttributeError, RuntimeError):
        return CPContext()


def full_keep_masks(
    keep_local: torch.Tensor,
    loss_masks: Sequence[torch.Tensor],
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    cp: CPContext,
) -> list[torch.Tensor]:
    """``loss_masks[i] * keep`` (full length, dtype of the mask) from this rank's flat ``keep_local``.

    With CP, one all-reduce over ``cp.group`` assembles every rank's decisions.
    """
    if cp.size == 1:
        pieces = keep_local.split(list(response_lengths))
        return [m * k.to(device=m.device, dtype=m.dtype) for m, k in zip(loss_masks, pieces)]
    import torch.distributed as dist

    full = torch.zeros(sum(response_lengths), dtype=torch.float32, device=keep_local.device)
    local = keep_local.to(torch.float32)
    pos = src = 0
    for total, resp in zip(total_lengths, response_lengths):
        (a0, a1), (b0, b1) = cp_response_ranges(cp.rank, cp.size, total, resp)
        n0, n1 = a1 - a0, b1 - b0
        full[pos + a0 : pos + a1] = local[src : src + n0]
        full[pos + b0 : pos + b1] = local[src + n0 : src + n0 + n1]
        pos, src = pos + resp, src + n0 + n1
    dist.all_reduce(full, op=dist.ReduceOp.SUM, group=cp.group)
    pieces = full.split(list(response_lengths))
    return [m * (k > 0.5).to(device=m.device, dtype=m.dtype) for m, k in zip(loss_masks, pieces)]


def _check_inputs(pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, cp):
    if rollout_log_probs is None or (isinstance(rollout_log_probs, (list, tuple)) and len(rollout_log_probs) == 0
                                     and len(train_log_probs) > 0):
        raise ValueError(
            "rollout_log_probs is missing from the batch: dis/icepop need the engine's log-probs. Fix: make the "
            "rollout return them (SGLang: return_logprob, slime sets Sample.rollout_log_probs)"
        )
    n = len(response_lengths)
    for name, seq in (("train_log_probs", train_log_probs), ("rollout_log_probs", rollout_log_probs),
                      ("loss_masks", loss_masks), ("total_lengths", total_lengths)):
        if len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} samples, response_lengths has {n}")
    for i, (t, r, m) in enumerate(zip(train_log_probs, rollout_log_probs, loss_masks)):
        local = cp_local_length(cp.rank, cp.size, total_lengths[i], response_lengths[i])
        if t.numel() != local or r.numel() != local:
            raise ValueError(
                f"sample {i}: train_log_probs has {t.numel()} and rollout_log_probs {r.numel()} entries, expected "
                f"the CP-local length {local} (cp rank {cp.rank} of {cp.size})"
            )
        if m.numel() != response_lengths[i]:
            raise ValueError(f"sample {i}: loss_mask has {m.numel()} entries, expected response_length "
                             f"{response_lengths[i]} (slime keeps loss masks full length)")
    if pg_loss.dim() != 1 or pg_loss.numel() != sum(t.numel() for t in train_log_probs):
        raise ValueError(f"pg_loss has shape {tuple(pg_loss.shape)}, expected the flat CP-local token count "
                         f"{sum(t.numel() for t in train_log_probs)}")


def _tis_step(step):
    """The public TIS step on slime's batch around ``step``: resolves the CP context (``cp=None``: Megatron's),
    checks the inputs and calls ``step(pg_loss, old, rollout, loss_masks, total_lengths, response_lengths, cp,
    **band)`` with this rank's old and rollout log-probs concatenated flat (detached, on ``pg_loss``'s device)."""

    def apply(
        pg_loss: torch.Tensor,
        train_log_probs: Sequence[torch.Tensor],
        rollout_log_probs: Sequence[torch.Tensor],
        loss_masks: Sequence[torch.Tensor],
        total_lengths: Sequence[int],
        response_lengths: Sequence[int],
        *,
        cp: CPContext | None = None,
        **band: Any,
    ) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
        cp = cp_context() if cp is None else cp
        _check_inputs(pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, cp)
        if train_log_probs:
            old, rollout = (torch.cat([t.detach().reshape(-1) for t in lps]).to(pg_loss.device)
                            for lps in (train_log_probs, rollout_log_probs))
        else:
            old = rollout = torch.zeros(0, dtype=torch.float32, device=pg_loss.device)
        return step(pg_loss, old, rollout, loss_masks, total_lengths, response_lengths, cp, **band)

    apply.__name__, apply.__qualname__, apply.__doc__ = step.__name__, step.__qualname__, step.__doc__
    return apply


def _mismatch_metrics(prefix: str, delta: torch.Tensor, keep: torch.Tensor) -> dict[str, torch.Tensor]:
    fin = torch.isfinite(delta)
    d = torch.where(fin, delta, torch.zeros_like(delta)).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        f"{prefix}_masked": (~keep).to(torch.float32),
        f"{prefix}_ratio": torch.where(fin, torch.exp(d), torch.zeros_like(d)).to(torch.float32),
        f"{prefix}_k3_kl": (torch.expm1(d) - d).to(torch.float32),
        f"{prefix}_logratio_abs": d.abs().to(torch.float32),
    }


# ---- DIS -------------------------------------------------------------------------------------------
def dis_band(settings: Any) -> tuple[float, float]:
    """(eps_low, eps_high) from the ``dis`` settings view."""
    band = resolve_dis_band(settings.preset, settings.eps_low, settings.eps_high, "ascend_dis_")
    return band.eps_low, band.eps_high


@_tis_step
def dis_apply(pg_loss, old, rollout, loss_masks, total_lengths, response_lengths, cp, *, eps_low: float,
              eps_high: float, reweight: bool = True):
    """The DIS TIS step with explicit band and CP context (see module docstring)."""
    delta = log_ratio(old, rollout)
    w = torch.exp(delta)  # same ratio and strict band as masks.dis_mask
    low, high = w <= 1.0 - eps_low, w >= 1.0 + eps_high
    keep = in_dis_band(w, eps_low, eps_high)
    weight = w.to(pg_loss.dtype) if reweight else torch.ones_like(pg_loss)
    new_loss = torch.where(keep, pg_loss * weight, torch.zeros_like(pg_loss))
    masks = full_keep_masks(keep, loss_masks, total_lengths, response_lengths, cp)
    metrics = _mismatch_metrics("dis", delta, keep)
    metrics["dis_low"] = low.to(torch.float32)
    metrics["dis_high"] = high.to(torch.float32)
    return new_loss, masks, metrics


def dis_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths,
            **kwargs):
    """tis chain contribution (order 100) of the ``dis`` plugin."""
    from ..plugins import runtime

    s = runtime.settings(args, "dis")
    eps_low, eps_high = dis_band(s)
    return dis_apply(pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths,
                     eps_low=eps_low, eps_high=eps_high, reweight=s.weight == "ratio")


# ---- IcePop ----------------------------------------------------------------------------------------
@_tis_step
def icepop_apply(pg_loss, old, rollout, loss_masks, total_lengths, response_lengths, cp, *, beta: float,
                 low: float | None = None, reweight: bool = True):
    """The IcePop TIS step (see module docstring). Masks are returned unchanged."""
    weight, keep = icepop_weights(old, rollout, beta, low=low, reweight=reweight)
    new_loss = torch.where(keep, pg_loss * weight.to(pg_loss.dtype), torch.zeros_like(pg_loss))
    return new_loss, list(loss_masks), _mismatch_metrics("icepop", log_ratio(old, rollout), keep)


def icepop_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths,
               **kwargs):
    """tis chain contribution (order 200) of the ``icepop`` plugin."""
    from ..plugins import runtime

    s = runtime.settings(args, "icepop")
    return icepop_apply(pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths,
                        beta=s.beta, low=s.low, reweight=s.reweight)


# ---- start-up checks -------------------------------------------------------------------------------
def _check_tis_args(args: Any, plugin: str) -> None:
    if not (getattr(args, "use_tis", False) or getattr(args, "get_mismatch_metrics", False)):
        raise SettingsError(
            f"plugin {plugin!r} acts through slime's TIS hook, which slime calls only with use_tis or "
            "get_mismatch_metrics. Fix: keep `use_tis: true` from the YAML `slime-ascend config` writes, "
            "or pass --use-tis"
        )
    if getattr(args, "use_rollout_logprobs", False):
        raise SettingsError(
            f"plugin {plugin!r}: --use-rollout-logprobs makes the engine log-probs the PPO old policy, so the "
            "decoupled ratio would be applied twice (slime forbids use_rollout_logprobs with use_tis). "
            "Fix: drop --use-rollout-logprobs"
        )
    path = getattr(args, "custom_tis_function_path", TIS_DISPATCHER)
    if path != TIS_DISPATCHER:
        raise SettingsError(
            f"plugin {plugin!r} needs custom_tis_function_path={TIS_DISPATCHER!r}, but it is {path!r}, so the "
            "plugin would never run. Fix: remove --custom-tis-function-path from the command line"
        )
    loss_type = getattr(args, "loss_type", "policy_loss")
    if loss_type != "policy_loss":
        raise SettingsError(
            f"plugin {plugin!r} acts inside slime's policy_loss_function (the TIS hook), but loss_type is "
            f"{loss_type!r} so it would never run. Fix: use loss_type policy_loss, or a plugin whose loss "
            "applies DIS itself (e.g. sao)"
        )


def validate_dis(args: Any, settings: Any) -> None:
    _check_tis_args(args, "dis")
    try:
        dis_band(settings)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    from ..plugins import runtime

    if "icepop" in runtime.enabled_names(args) and settings.weight == "ratio":
        raise SettingsError(
            "dis (ascend_dis_weight: ratio) and icepop both multiply the loss by the same train/rollout ratio, "
            "which would apply it twice. Fix: set ascend_dis_weight: mask to use DIS as a band on top of IcePop, "
            "or enable only one of them"
        )


def validate_icepop(args: Any, settings: Any) -> None:
    _check_tis_args(args, "icepop")
    low = 1.0 / settings.beta if settings.low is None else settings.low
    if not 0.0 <= low <= settings.beta:
        raise SettingsError(
            f"ascend_icepop_low={settings.low!r} must lie in [0, ascend_icepop_beta={settings.beta}]. Fix: lower it "
            "or leave it unset (1/beta)"
        )

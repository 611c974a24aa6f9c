"""Off-policy control: the hook code of the ``dis``, ``icepop`` and ``staleness`` plugins
(declared in :mod:`slime_ascend.offpolicy.plugin`).

* ``dis`` / ``icepop``: contributions to slime's TIS hook (``--custom-tis-function-path``), in the train
  actor; see the section "TIS" below.
* ``staleness``: the first step of the ``reward_post_process`` chain, in the rollout manager; see the
  section "staleness" below.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from ..algorithms.cp import cp_local_length, cp_response_ranges
from ..algorithms.masks import icepop_weights, in_dis_band, log_ratio, resolve_dis_band
from ..algorithms.mismatch import SAFETY_BOUND
from ..algorithms.staleness import SampleStatus, filter_groups, parse_weight_versions
from ..plugins.settings import SettingsError

# ==================================================================================================
# TIS: dis and icepop
#
# ``dis`` and ``icepop`` as contributions to slime's TIS hook (``--custom-tis-function-path``).
#
# What slime passes (``policy_loss_function``, slime/backends/megatron_utils/loss.py): ``pg_loss`` is the
# per-token PPO loss of this CP rank's tokens (flat, samples concatenated); ``train_log_probs`` are the
# trainer's *old* log-probs (``batch["log_probs"]``, recomputed before the update; the detached current
# ones when slime skipped the recompute, which it does only when they are equal); ``rollout_log_probs``
# are the engine's; both are lists of CP-local per-sample tensors. ``loss_masks`` are full length per
# sample. slime multiplies nothing else in: it rebuilds the loss reducer from the masks we return,
# keeping the pre-TIS per-rollout denominators (``rollout_mask_sums``), and reduces every metric (a flat
# per-token tensor like ``pg_loss``) with the *original* masks.
#
# DIS (order 100). w = exp(logp_old - logp_rollout); keep = 1 - eps_low < w < 1 + eps_high (strict).
# Outside the band the token's PPO loss is zeroed and its loss mask cleared, so entropy / KL / clip-frac
# skip it too while the denominators stay the pre-mask token counts (SAO: masked tokens still count in
# the token mean). Inside the band the loss is multiplied by w (``ascend_dis_weight: ratio``) or by 1
# (``mask``). Equivalence with the paper's -sg[f(r)]·A·logπθ, r = πθ/π_rollout: where PPO's clip is
# inactive, the PPO loss -(πθ/π_old)·A has gradient -(πθ/π_old)·A·∇logπθ, and times w that is
# -r·A·∇logπθ, exactly the paper's gradient. The band is tested on w (π_old) instead of r (πθ); the two
# are equal at θ = θ_old, i.e. on the first optimizer step on a batch, where PPO's clip is also inactive.
# So at that step the gradient equals :func:`~slime_ascend.algorithms.masks.dis_policy_loss`'s (tested);
# the loss *value* differs (-r·A versus -r·A·logπθ). For pure DIS at later steps too, widen PPO's clip
# (``--eps-clip``), since DIS is not PPO clipping.
#
# IcePop (order 200). ρ = w, weight M(ρ) = ρ on [low, beta] (inclusive), else 0, multiplied into the PPO
# loss; masks returned unchanged (IcePop's 1/|y| keeps masked tokens in the denominator). Equal to
# slime's ``icepop_function`` with ``--tis-clip beta --tis-clip-low low``.
#
# Metrics (flat per-token, this rank's tokens, so slime's reducer averages them over trainable tokens):
# ``<p>_masked`` (1 outside the band), ``<p>_ratio`` (w, with log w clamped to ±20), ``<p>_k3_kl``
# (exp(Δ)-1-Δ, Δ = log w clamped to ±20: the k3 estimate of KL(π_rollout‖π_old)), ``<p>_logratio_abs``
# (|Δ|); DIS adds ``dis_low`` / ``dis_high`` (below / above the band). Non-finite Δ counts as masked
# with 0 in the other metrics.
#
# Context parallelism: everything per token is computed on the local tokens. Only the returned
# full-length masks need the other ranks' decisions: each rank writes its kept flags at its zig-zag
# positions of a zero buffer over the whole micro-batch, and one all-reduce (SUM) over the CP group
# completes it (the pattern of slime's ``mis.py``, with one collective per call instead of one per
# sample).

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


# ==================================================================================================
# staleness
#
# ``staleness``: drop stale and environment-failed rollouts before slime builds the train data.
#
# Runs in the rollout manager as the first step of our ``reward_post_process`` chain (order 100),
# inside slime's ``_convert_samples_to_train_data``, before it builds the loss masks. A dropped sample
# gets ``sample.remove_sample = True``; slime then replaces its loss mask with zeros
# (slime/ray/rollout.py, ``_convert_samples_to_train_data``), so it trains nothing and adds nothing
# to its rollout's loss denominator (``rollout_mask_sums``).
#
# Unit: a *rollout* (samples sharing ``rollout_id``, else one sample by ``index``); its versions are all
# its samples' ``weight_versions``, it failed if any sample's status is FAILED or ABORTED. Groups are
# the rollouts sharing ``group_index`` (none: each rollout alone).
#
# Trainer version: the version every rollout engine acknowledged last
# (:mod:`slime_ascend.weight_sync.served_version`, published by the ``driver.acknowledged_weight_update``
# patch after it read every engine's version back), or, before any acknowledged switch or where no switch
# is acknowledged (another transport), the newest weight version seen so far in this process (the
# high-water mark of every ``Sample.weight_versions`` entry that reached this hook: an engine reports v
# only after the trainer produced v, so a lower bound); the larger of the two. Each sample's versions are
# the ones its engine's responses reported (SGLang ``meta_info["weight_version"]``).
# Lag = trainer_version - min(versions); stale iff lag > ``ascend_staleness_tau``.
#
# With ``ascend_staleness_group_rule`` (GLM-5): a rollout is invalid if stale or failed; a group with
# fewer than half valid rollouts (``2 * valid < rollouts in the group``) is dropped whole; in a kept
# group each invalid rollout is *padded*: dropped, and given the reward and ``rollout_id`` of a valid
# rollout of its group (round robin, :func:`~slime_ascend.algorithms.staleness.filter_groups`). The
# group normalisation that follows (which counts each ``rollout_id`` once) then sees only the valid
# rollouts, so the baseline is the valid members' mean and std, and the group keeps its shape. Without
# the rule only stale rollouts are dropped and their rewards stay in the group baseline.
#
# Returns ``(raw_rewards, rewards)``: ``raw_rewards`` unchanged; ``rewards`` unchanged except padded
# rollouts (the valid source's reward). Each sample's ``metadata["ascend_staleness"]`` records
# ``action`` (keep, drop_stale, drop_env_failed, drop_group, pad; a pad also has ``reason``: stale or
# env_failed, ``original_rollout_id`` and ``padded_from_index``), ``lag`` and ``trainer_version``; the
# counts are kept for :func:`last_staleness_report` and reported on slime's rollout metrics as
# ``rollout/staleness_*``: a ``staleness <rollout_id>: {...}`` line in the RolloutManager's log and slime's
# trackers (:func:`slime_ascend.plugins.rollout_metrics.report`).

__all__ += ["last_staleness_report", "reset_state", "staleness_post_process", "validate_staleness"]

logger = logging.getLogger("slime_ascend.staleness")

FAILED_STATUSES = ("FAILED", "ABORTED")

_lock = threading.Lock()
_state: dict[str, Any] = {"high_water": 0, "report": None}


def reset_state() -> None:
    """Forget the version high-water mark and the last report (tests)."""
    with _lock:
        _state.update(high_water=0, report=None)


def last_staleness_report() -> dict[str, Any] | None:
    """Counts and reasons of the last call in this process (a copy), or None before the first."""
    with _lock:
        report = _state["report"]
    return None if report is None else {k: (dict(v) if isinstance(v, dict) else v) for k, v in report.items()}


def _status_name(sample: Any) -> str:
    status = getattr(sample, "status", None)
    return str(getattr(status, "name", status)).upper()


def _rollout_key(sample: Any) -> Any:
    return sample.rollout_id if getattr(sample, "rollout_id", None) is not None else ("index", sample.index)


def staleness_post_process(args: Any, samples: list, raw_rewards: list, rewards: list) -> tuple[list, list]:
    """reward_post_process chain contribution (order 100) of the ``staleness`` plugin."""
    from ..plugins import runtime

    s = runtime.settings(args, "staleness")
    if len(samples) != len(rewards) or len(samples) != len(raw_rewards):
        raise ValueError(f"got {len(samples)} samples, {len(raw_rewards)} raw rewards and {len(rewards)} rewards")
    rewards = list(rewards)

    # rollouts, in order of first appearance
    members: dict[Any, list[int]] = {}
    for i, sample in enumerate(samples):
        members.setdefault(_rollout_key(sample), []).append(i)
    keys = list(members)
    versions: dict[Any, list[int]] = {}
    failed: dict[Any, bool] = {}
    unversioned = 0
    for key in keys:
        parsed: list[int] = []
        for i in members[key]:
            try:
                parsed += parse_weight_versions(list(getattr(samples[i], "weight_versions", None) or []))
            except ValueError as e:
                raise ValueError(f"sample index={samples[i].index}: {e}") from None
        failed[key] = any(_status_name(samples[i]) in FAILED_STATUSES for i in members[key])
        if not parsed and not failed[key]:
            if s.unversioned == "error":
                raise ValueError(
                    f"sample index={samples[members[key][0]].index} has no weight_versions, so its staleness is "
                    "unknown. Fix: use an engine that reports meta_info['weight_version'] (SGLang), or set "
                    "ascend_staleness_unversioned: keep"
                )
            unversioned += 1
        versions[key] = parsed

    with _lock:
        newest = max([_state["high_water"]] + [v for vs in versions.values() for v in vs])
        _state["high_water"] = newest
    acknowledged = _acknowledged_version()
    trainer_version, tau = max(newest, acknowledged or 0), s.tau
    lag = {k: (trainer_version - min(v) if v else 0) for k, v in versions.items()}

    action: dict[Any, str] = {}
    alias: dict[Any, Any] = {}  # padded rollout -> valid source rollout
    dropped_groups = 0
    if s.group_rule:
        groups: dict[Any, list[Any]] = {}
        for key in keys:
            g = getattr(samples[members[key][0]], "group_index", None)
            groups.setdefault(("group", g) if g is not None else ("alone", key), []).append(key)
        group_keys = list(groups.values())
        result = filter_groups(
            [[SampleStatus(weight_versions=versions[k] or [trainer_version], env_failed=failed[k]) for k in grp]
             for grp in group_keys],
            trainer_version, tau,
        )
        dropped_groups = result.dropped_group
        for grp, kept, src, train in zip(group_keys, result.keep_group, result.source, result.train):
            for j, key in enumerate(grp):
                reason = "drop_env_failed" if failed[key] else "drop_stale" if lag[key] > tau else None
                if not kept:
                    action[key] = "drop_group" if reason is None else reason
                elif train[j]:
                    action[key] = "keep"
                else:
                    action[key] = "pad"
                    alias[key] = grp[src[j]]
    else:
        for key in keys:
            action[key] = "drop_stale" if lag[key] > tau else "keep"

    # give each padding source an explicit rollout_id so that its padded siblings can share it
    taken = {sm.rollout_id for sm in samples if getattr(sm, "rollout_id", None) is not None}
    fresh = max([x for x in taken if isinstance(x, int)] + [-1]) + 1
    source_id: dict[Any, Any] = {}
    for src_key in dict.fromkeys(alias.values()):
        first = samples[members[src_key][0]]
        if first.rollout_id is None:
            while fresh in taken:
                fresh += 1
            for i in members[src_key]:
                samples[i].rollout_id = fresh
            taken.add(fresh)
        source_id[src_key] = first.rollout_id

    for key in keys:
        act = action[key]
        for i in members[key]:
            sample = samples[i]
            record = {"action": act, "lag": lag[key], "trainer_version": trainer_version}
            if act != "keep":
                sample.remove_sample = True
            if act == "pad":
                record["reason"] = "env_failed" if failed[key] else "stale"
                src_first = members[alias[key]][0]
                record["original_rollout_id"] = sample.rollout_id
                record["padded_from_index"] = samples[src_first].index
                sample.rollout_id = source_id[alias[key]]
                rewards[i] = rewards[src_first]
            if getattr(sample, "metadata", None) is None:
                sample.metadata = {}
            sample.metadata["ascend_staleness"] = record

    per_action = Counter(action[k] for k in keys)
    lag_hist = Counter(lag[k] for k in keys if not failed[k] and versions[k])
    stale = sum(1 for k in keys if not failed[k] and lag[k] > tau)
    report = {
        "samples": len(samples),
        "rollouts": len(keys),
        "trainer_version": trainer_version,
        "tau": tau,
        "kept": per_action["keep"],
        "padded": per_action["pad"],
        "dropped": len(keys) - per_action["keep"] - per_action["pad"],
        "stale": stale,
        "env_failed": sum(1 for k in keys if failed[k]) if s.group_rule else 0,
        "dropped_groups": dropped_groups,
        "dropped_group_members": per_action["drop_group"],
        "unversioned": unversioned,
        "max_lag": max(lag_hist) if lag_hist else 0,
        "lag_histogram": dict(sorted(lag_hist.items())),
        "acknowledged_version": acknowledged if acknowledged is not None else -1,
    }
    with _lock:
        _state["report"] = report
    from ..plugins.rollout_metrics import report as report_rollout

    report_rollout(args, logger, "staleness", {METRIC_PREFIX + key: float(report[key]) for key in METRIC_KEYS})
    if report["kept"] != report["rollouts"] or unversioned:
        logger.info(
            "staleness: trainer version %d, tau %d: of %d rollouts kept %d, padded %d, dropped %d; invalid: %d stale "
            "(lag > tau), %d env-failed; %d groups dropped (< half valid) taking %d valid rollouts with them; "
            "%d without a weight version; lags %s",
            trainer_version, tau, len(keys), report["kept"], report["padded"], report["dropped"], stale,
            report["env_failed"], dropped_groups, report["dropped_group_members"], unversioned, report["lag_histogram"],
        )
    return raw_rewards, rewards


METRIC_PREFIX = "rollout/staleness_"
METRIC_KEYS = ("rollouts", "kept", "padded", "dropped", "stale", "env_failed", "dropped_groups", "unversioned",
               "max_lag", "trainer_version", "acknowledged_version")


def _acknowledged_version() -> int | None:
    """The version every engine acknowledged last in this job (None: no acknowledged switch yet, or not
    under Ray)."""
    if "ray" not in sys.modules:
        return None
    try:
        import ray

        if not ray.is_initialized():
            return None
        from ..weight_sync import served_version

        return served_version.acknowledged()
    except Exception as exc:  # noqa: BLE001 - the high-water mark still bounds the trainer's version
        logger.warning("staleness: could not read the acknowledged weight version (%s); using the newest seen",
                       " ".join(str(exc).split())[:200])
        return None


def validate_staleness(args: Any, settings: Any) -> None:
    path = getattr(args, "custom_convert_samples_to_train_data_path", None)
    if path and path != "slime_ascend.hooks.convert_samples_to_train_data":
        raise SettingsError(
            f"plugin 'staleness' runs in slime's reward post-process, which the custom converter {path!r} "
            "bypasses. Fix: remove --custom-convert-samples-to-train-data-path"
        )

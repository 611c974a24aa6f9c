"""CompactionRL credit on slime: shared rewards (rollout side) and cross-segment GAE (train side).

Rollout side (reward_post_process, order 500): :func:`share_final_reward` gives every segment of a
rollout the reward of its last segment, and reports the rollout's :func:`segment_counts` (``compaction
<rollout_id>: {'rollout/compaction_*': ...}`` in the log and at slime's rollout step in its trackers). The
dispatcher then normalises per prompt group counting each rollout once.

Train side (advantage chain; slime calls it on the last pipeline stage of the actor and of the critic,
with ``rollout_data`` holding this data-parallel rank's samples):

* order 50, :func:`prepare_segments`: the segments of one rollout may sit on different DP ranks, so the
  per-sample ``(rollout_id, round_number, trainable tokens)`` are all-gathered over the DP group (without
  CP; CP ranks of one DP rank hold the same samples). Stores, per local sample,
  ``rollout_data["rollout_trainable_tokens"]`` (trainable tokens of the whole rollout; a base estimator
  that wants one length-adaptive lambda per rollout uses it) and ``["trainable_tokens_after"]``
  (N_after(s)). ``round_number`` is the segment index (set by the compaction generate; slime forwards it).
* order 150, :func:`base_advantages`: for ``ppo``, when no earlier contribution (sao's at 100) set
  ``rollout_data["advantages"]``: a local skip-observation GAE per segment (the shared
  :func:`~slime_ascend.advantage_base.skip_observation_advantages`: bootstrap 0 after the segment's last
  action; rewards ``-kl_coef * kl`` plus the scalar reward on the last action token; one lambda per
  rollout; sets ``rollout_data["gae_lambdas"]`` and ``["gae_gammas"]``). For every other estimator the
  advantage dispatcher runs slime's own at the chain's base order (200), before the decay.
* order 300, :func:`decay_advantages`: ``A(s, i) = (gamma * lambda) ** N_after(s) * A_local(s, i)``.
  lambda is ``rollout_data["gae_lambdas"]`` and gamma ``rollout_data["gae_gammas"]`` (one float per local
  sample each, set by whichever base estimator ran GAE) when present, else ``ascend_compaction_lambda_mode``
  and slime's ``--gamma``. ``gamma * lambda`` must be the same for all segments of a rollout (checked
  across ranks). With ``critic_target="decayed"`` returns are shifted by the same
  amount (``returns - advantages`` unchanged, so ``returns = decayed A + V`` for GAE). Stores the factors
  in ``rollout_data["compaction_decay"]`` (slime logs it as ``rollout/compaction_decay``).

Token-level normalisation across segments is slime's: ``rollout_mask_sums`` make the reducer a
per-rollout token mean over all segments, and a step counts rollouts.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

from slime_ascend.advantage_base import skip_observation_advantages
from slime_ascend.algorithms.gae import (
    apply_segment_decay,
    length_adaptive_lambdas,
    segment_decay_factors,
    trainable_token_counts,
)
from slime_ascend.megatron_state import dp_group as _dp_group

__all__ = [
    "SUPPORTED_ESTIMATORS",
    "SegmentLayout",
    "all_gather_rows",
    "base_advantages",
    "decay_advantages",
    "prepare_segments",
    "segment_layout",
    "share_final_reward",
    "validate",
]

PLUGIN_NAME = "compaction"
SUPPORTED_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")


# ----------------------------------------------------------------------------------------------
# validation (every process, first use)
# ----------------------------------------------------------------------------------------------


def validate(args: Any, settings: Any) -> None:
    """Reject slime settings under which compaction credit would be silently wrong."""
    from slime_ascend.plugins.settings import SettingsError

    estimator = getattr(args, "advantage_estimator", None)
    if estimator is not None and estimator not in SUPPORTED_ESTIMATORS:
        raise SettingsError(
            f"compaction: advantage_estimator={estimator!r} is not supported; use one of {SUPPORTED_ESTIMATORS}"
        )
    converter = getattr(args, "custom_convert_samples_to_train_data_path", None)
    if converter is not None and converter != "slime_ascend.hooks.convert_samples_to_train_data":
        raise SettingsError(
            f"compaction: custom_convert_samples_to_train_data_path={converter!r} makes slime skip the reward "
            "post-process (shared rewards, per-rollout normalisation) and may drop round_number. Fix: unset it."
        )
    if getattr(args, "custom_pg_loss_reducer_function_path", None) is not None:
        raise SettingsError(
            "compaction: custom_pg_loss_reducer_function_path does not receive rollout_mask_sums, so a rollout "
            "split into segments would no longer count once. Fix: unset it."
        )


# ----------------------------------------------------------------------------------------------
# rollout side
# ----------------------------------------------------------------------------------------------


def _compaction_rollouts(samples: Sequence[Any]) -> dict[Hashable, list[int]]:
    """Indices of the samples with ``metadata["compaction"]``, by rollout (``rollout_id``, else ``index``)."""
    groups: dict[Hashable, list[int]] = {}
    for i, sample in enumerate(samples):
        if (getattr(sample, "metadata", None) or {}).get("compaction"):
            rid = getattr(sample, "rollout_id", None)
            groups.setdefault(rid if rid is not None else sample.index, []).append(i)
    return groups


def share_final_reward(args: Any, samples: Sequence[Any], raw_rewards: list, rewards: list) -> tuple[list, list]:
    """Every segment of a compaction rollout takes the (raw and processed) reward of its last segment.

    Samples without ``metadata["compaction"]`` are left alone. A rollout whose segments are not all
    present (indices ``0 .. num_segments - 1``, once each) is an error: its credit could not be right.
    """
    if len(raw_rewards) != len(samples) or len(rewards) != len(samples):
        raise ValueError(
            f"share_final_reward: {len(samples)} samples but {len(raw_rewards)} raw rewards and {len(rewards)} rewards"
        )
    groups = _compaction_rollouts(samples)
    raw_out, out = list(raw_rewards), list(rewards)
    for key, idx in groups.items():
        seg = [int(samples[i].metadata["segment_index"]) for i in idx]
        num = {int(samples[i].metadata["num_segments"]) for i in idx}
        if len(num) != 1 or sorted(seg) != list(range(next(iter(num)))):
            raise ValueError(
                f"compaction rollout {key!r}: segment indices {sorted(seg)} with num_segments {sorted(num)}; every "
                "segment 0..num_segments-1 must be present exactly once (do not filter single segments)"
            )
        last = idx[seg.index(max(seg))]
        for i in idx:
            raw_out[i], out[i] = raw_out[last], out[last]
    if groups:
        from ..plugins.rollout_metrics import report

        report(args, logger, "compaction", segment_counts(samples))
    return raw_out, out


def segment_counts(samples: Sequence[Any]) -> dict[str, float]:
    """Per-rollout counts of a batch's compaction rollouts (samples with ``metadata["compaction"]``):
    rollouts, segments, compactions (a rollout of n segments was compacted n - 1 times), rollouts
    compacted at least once, mean and max segments per rollout."""
    segments = {key: len(idx) for key, idx in _compaction_rollouts(samples).items()}
    n = len(segments)
    total = sum(segments.values())
    return {
        "rollout/compaction_rollouts": float(n),
        "rollout/compaction_segments": float(total),
        "rollout/compaction_compactions": float(total - n),
        "rollout/compaction_compacted_rollouts": float(sum(1 for v in segments.values() if v > 1)),
        "rollout/compaction_segments_per_rollout": total / n if n else 0.0,
        "rollout/compaction_max_segments": float(max(segments.values(), default=0)),
    }


# ----------------------------------------------------------------------------------------------
# gathering segment metadata over data-parallel ranks
# ----------------------------------------------------------------------------------------------


def all_gather_rows(rows: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, int]:
    """All-gather an int64 ``[n, k]`` table with a different ``n`` per rank.

    Returns ``(rows of every rank in rank order, on CPU; offset of this rank's rows)``. ``group=None``,
    an uninitialised process group or a single rank returns ``rows`` itself and offset 0.
    """
    if rows.ndim != 2 or rows.dtype != torch.int64:
        raise TypeError(f"rows must be a 2-D int64 tensor, got {rows.dtype} {tuple(rows.shape)}")
    import torch.distributed as dist

    if group is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return rows.cpu(), 0
    world = dist.get_world_size(group)
    device = torch.device("cpu") if dist.get_backend(group) == "gloo" else rows.device
    n = torch.tensor([rows.shape[0]], dtype=torch.int64, device=device)
    sizes_t = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes_t, n, group=group)
    sizes = [int(s.item()) for s in sizes_t]
    padded = torch.zeros((max(sizes), rows.shape[1]), dtype=torch.int64, device=device)
    padded[: rows.shape[0]] = rows.to(device)
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    me = dist.get_rank(group)
    return torch.cat([o[:s] for o, s in zip(out, sizes, strict=True)]).cpu(), sum(sizes[:me])


def _rollout_ints(rollout_ids: Sequence[Any]) -> list[int]:
    out = []
    for rid in rollout_ids:
        value = int(rid.item()) if isinstance(rid, torch.Tensor) else rid
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"rollout_ids must be integers (slime assigns ints); got {rid!r} of type {type(rid).__name__}"
            )
        out.append(value)
    return out


@dataclass(frozen=True)
class SegmentLayout:
    """Per local sample: its segment index, trainable tokens, its rollout's trainable tokens, N_after."""

    segment_indices: list[int]
    trainable: list[int]
    rollout_trainable: list[int]
    trainable_after: list[int]


def _segment_indices(rollout_ids: Sequence[int], round_number: Sequence[Any] | None) -> list[int]:
    if round_number is None:
        if len(set(rollout_ids)) != len(rollout_ids):
            raise ValueError(
                "rollout_data has several samples per rollout but no round_number (the segment index). Fix: "
                "produce segments with slime_ascend.compaction.generate (it sets metadata['round_number']) "
                "and make sure samples[0].metadata has it, since slime forwards round_number only then"
            )
        return [0] * len(rollout_ids)
    if len(round_number) != len(rollout_ids):
        raise ValueError(f"round_number has {len(round_number)} entries, rollout_ids {len(rollout_ids)}")
    return [int(r) for r in round_number]


def segment_layout(
    rollout_ids: Sequence[Any],
    segment_indices: Sequence[int],
    trainable_counts: Sequence[int],
    *,
    group: Any = None,
) -> SegmentLayout:
    """Rollout totals and N_after for the local segments, counting segments on every rank of ``group``."""
    ids = _rollout_ints(rollout_ids)
    n = len(ids)
    if len(segment_indices) != n or len(trainable_counts) != n:
        raise ValueError(
            f"rollout_ids ({n}), segment_indices ({len(segment_indices)}) and trainable_counts "
            f"({len(trainable_counts)}) need one entry per sample"
        )
    rows = torch.tensor([[r, int(s), int(c)] for r, s, c in zip(ids, segment_indices, trainable_counts, strict=True)],
                        dtype=torch.int64).reshape(n, 3)
    every, offset = all_gather_rows(rows, group)
    per_rollout: dict[int, list[tuple[int, int]]] = {}
    for rid, seg, cnt in every.tolist():
        per_rollout.setdefault(rid, []).append((seg, cnt))
    totals: dict[int, int] = {}
    after: dict[tuple[int, int], int] = {}
    for rid, entries in per_rollout.items():
        entries.sort()
        segs = [s for s, _ in entries]
        if len(set(segs)) != len(segs):
            raise ValueError(f"rollout {rid}: duplicate segment index (round_number) in {segs}")
        running = 0
        for seg, cnt in reversed(entries):
            after[(rid, seg)] = running
            running += cnt
        totals[rid] = running
    local = every[offset : offset + n].tolist()
    return SegmentLayout(
        segment_indices=[s for _, s, _ in local],
        trainable=[c for _, _, c in local],
        rollout_trainable=[totals[r] for r, _, _ in local],
        trainable_after=[after[(r, s)] for r, s, _ in local],
    )


# ----------------------------------------------------------------------------------------------
# advantage chain contributions
# ----------------------------------------------------------------------------------------------


def _settings(args: Any) -> Any:
    from slime_ascend.plugins import runtime

    return runtime.settings(args, PLUGIN_NAME)


def _layout(rollout_data: dict, group: Any) -> SegmentLayout:
    ids = rollout_data["rollout_ids"]
    return segment_layout(
        ids,
        _segment_indices(_rollout_ints(ids), rollout_data.get("round_number")),
        trainable_token_counts(rollout_data["loss_masks"]),
        group=group,
    )


def prepare_segments(args: Any, rollout_data: dict) -> None:
    """Order 50: gather the segment layout over DP; store rollout totals and N_after per local sample."""
    layout = _layout(rollout_data, _dp_group())
    rollout_data["rollout_trainable_tokens"] = layout.rollout_trainable
    rollout_data["trainable_tokens_after"] = layout.trainable_after


def _rollout_lambdas(args: Any, settings: Any, rollout_data: dict) -> list[float]:
    n = len(rollout_data["rollout_ids"])
    given = rollout_data.get("gae_lambdas")
    if given is not None:
        if len(given) != n:
            raise ValueError(f"rollout_data['gae_lambdas'] has {len(given)} entries for {n} samples")
        return [float(v) for v in given]
    if settings.lambda_mode == "fixed":
        return [float(getattr(args, "lambd", 1.0))] * n
    totals = rollout_data.get("rollout_trainable_tokens")
    if totals is None:
        totals = _layout(rollout_data, _dp_group()).rollout_trainable
    return length_adaptive_lambdas(rollout_data["loss_masks"], settings.lambda_alpha, totals)


def base_advantages(args: Any, rollout_data: dict) -> None:
    """Order 150, ``ppo`` only: per-segment skip-observation GAE unless an earlier contribution (sao's at
    100) set ``advantages``. Other estimators get slime's own from the dispatcher's base step."""
    if rollout_data.get("advantages") is not None or getattr(args, "advantage_estimator", "grpo") != "ppo":
        return
    skip_observation_advantages(args, rollout_data, gamma=float(getattr(args, "gamma", 1.0)),
                                lambdas=_rollout_lambdas(args, _settings(args), rollout_data), plugin=PLUGIN_NAME)


def decay_advantages(args: Any, rollout_data: dict) -> None:
    """Order 300: ``advantages *= (gamma * lambda) ** N_after(s)``; see the module doc for returns."""
    advantages = rollout_data.get("advantages")
    if advantages is None:
        raise ValueError("compaction decay runs at order 300 but no base estimator set rollout_data['advantages']")
    settings = _settings(args)
    group = _dp_group()
    ids = _rollout_ints(rollout_data["rollout_ids"])
    n = len(ids)
    segs = _segment_indices(ids, rollout_data.get("round_number"))
    counts = trainable_token_counts(rollout_data["loss_masks"])
    lambdas = _rollout_lambdas(args, settings, rollout_data)
    gammas = rollout_data.get("gae_gammas")
    if gammas is None:
        gammas = [float(getattr(args, "gamma", 1.0))] * n
    elif len(gammas) != n:
        raise ValueError(f"rollout_data['gae_gammas'] has {len(gammas)} entries for {n} samples")
    # (gamma * lambda) ** N_after: the product is the per-rollout discount (checked equal across segments)
    base = torch.tensor([float(g) * lam for g, lam in zip(gammas, lambdas, strict=True)], dtype=torch.float64)
    rows = torch.cat(
        [torch.tensor([ids, segs, counts], dtype=torch.int64).reshape(3, n).T, base.view(torch.int64).reshape(n, 1)],
        dim=1,
    )
    every, offset = all_gather_rows(rows, group)
    every_base = every[:, 3].contiguous().view(torch.float64).tolist()
    factors = segment_decay_factors(
        every[:, 0].tolist(), every[:, 1].tolist(), every[:, 2].tolist(), 1.0, every_base
    )[offset : offset + n]
    decayed = apply_segment_decay(advantages, factors)
    returns = rollout_data.get("returns")
    if returns is not None and settings.critic_target == "decayed":
        rollout_data["returns"] = [r + (d - a) for r, a, d in zip(returns, advantages, decayed, strict=True)]
    rollout_data["advantages"] = decayed
    rollout_data["compaction_decay"] = factors

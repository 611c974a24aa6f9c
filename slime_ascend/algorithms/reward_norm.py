"""Group reward normalisation that counts each rollout once.

slime normalises rewards per prompt group only when every rollout is one sample; otherwise it
falls back to the whole batch. Here a group is the samples sharing ``group_index`` and each
rollout (``rollout_id``) contributes one reward however many samples (segments) it has. With one
sample per rollout and full groups this equals slime's default GRPO normalisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def group_normalise(
    rewards: Sequence[float],
    group_ids: Sequence[object],
    rollout_ids: Sequence[object],
    *,
    divide_by_std: bool,
    eps: float = 1e-6,
) -> list[float]:
    """Per-sample normalised rewards: (r - mean_group) / (std_group + eps) over rollouts.

    ``std`` is the unbiased standard deviation over the group's rollouts (as ``torch.std``); a group of one
    rollout has spread 0, so its sample's normalised reward is 0, not NaN.
    Samples of one rollout must carry the same reward.
    """
    n = len(rewards)
    if not (len(group_ids) == len(rollout_ids) == n):
        raise ValueError(
            f"rewards ({n}), group_ids ({len(group_ids)}) and rollout_ids ({len(rollout_ids)}) must have one entry per sample"
        )
    per_rollout: dict[object, float] = {}
    rollout_group: dict[object, object] = {}
    for reward, group, rollout in zip(rewards, group_ids, rollout_ids):
        key = (group, rollout)
        if key in per_rollout and per_rollout[key] != reward:
            raise ValueError(
                f"rollout {rollout!r} has samples with different rewards ({per_rollout[key]} and {reward}); "
                "every segment of a rollout must carry the trajectory's final reward"
            )
        per_rollout[key] = float(reward)
        rollout_group[key] = group
    # float32 tensor arithmetic, as slime's default normalisation does
    stats: dict[object, tuple[torch.Tensor, torch.Tensor]] = {}
    for group in dict.fromkeys(rollout_group.values()):
        values = torch.tensor([r for k, r in per_rollout.items() if rollout_group[k] == group], dtype=torch.float32)
        # one rollout (e.g. the only valid member of a group the staleness rule kept): its centred reward is
        # exactly 0, and torch's std of one value is NaN, which would make the advantage NaN; the spread is 0
        stats[group] = (values.mean(), values.std() if len(values) > 1 else torch.zeros(()))
    out = []
    for reward, group in zip(rewards, group_ids):
        mean, std = stats[group]
        value = torch.tensor(float(reward), dtype=torch.float32) - mean
        if divide_by_std:
            value = value / (std + eps)
        out.append(float(value))
    return out

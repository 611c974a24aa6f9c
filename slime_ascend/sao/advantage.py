"""SAO skip-observation GAE as slime's advantage hook, correct under context parallelism.

slime calls the advantage chain on the last pipeline stage of the actor and of the critic with this
data-parallel rank's ``rollout_data``: ``values`` and ``kl`` are CP-local (zig-zag), ``loss_masks``
full length, ``rewards`` one scalar per sample. We gather the CP-local vectors into full ones (one
all-gather per tensor kind), run :func:`skip_observation_gae` on full sequences, and slice the results
back to this rank's layout (as slime's own GAE does).

Rewards per token: ``-kl_coef * kl`` plus the scalar reward on the last *action* token (SAO puts the
terminal reward on the last trainable token, not on a trailing observation).

Lambda: in the actor, ``1 - 1 / (alpha * l)`` per rollout, ``l`` = the rollout's trainable tokens
(``rollout_data["rollout_trainable_tokens"]`` when the compaction plugin provides rollout totals,
else the sample's own loss-mask sum); in the critic, ``ascend_sao_critic_lambda`` (1). The critic is
recognised by the ``train.critic_advantage_function`` patch (:func:`~slime_ascend.plugins.roles.in_critic_pass`). The lambdas
used are stored in ``rollout_data["gae_lambdas"]`` for later chain steps (compaction decay).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from slime_ascend.algorithms.cp import cp_full_vectors, cp_slice
from slime_ascend.algorithms.gae import length_adaptive_lambda, skip_observation_gae, terminal_rewards_on_last_action
from slime_ascend.megatron_state import AllGather, cp_state

__all__ = ["cp_state", "policy_lambdas", "sao_gae", "skip_observation_advantages"]

PLUGIN_NAME = "sao"


def policy_lambdas(loss_masks: Sequence[torch.Tensor], alpha: float,
                   rollout_trainable_tokens: Sequence[int] | None = None) -> list[float]:
    """Length-adaptive lambda per sample, from the rollout totals when given, else each loss mask."""
    if rollout_trainable_tokens is not None:
        if len(rollout_trainable_tokens) != len(loss_masks):
            raise ValueError(
                f"rollout_trainable_tokens has {len(rollout_trainable_tokens)} entries for {len(loss_masks)} samples"
            )
        counts = [int(c) for c in rollout_trainable_tokens]
    elif loss_masks:
        counts = [int(c) for c in torch.stack([(torch.as_tensor(m) != 0).sum() for m in loss_masks]).tolist()]
    else:
        counts = []
    return [length_adaptive_lambda(c, alpha) for c in counts]


def sao_gae(
    values: Sequence[torch.Tensor],
    kl: Sequence[torch.Tensor],
    rewards: Sequence[float],
    loss_masks: Sequence[torch.Tensor],
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    *,
    gamma: float,
    lambdas: float | Sequence[float],
    kl_coef: float = 0.0,
    cp_rank: int = 0,
    cp_size: int = 1,
    all_gather: AllGather | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Skip-observation GAE on CP-local ``values`` / ``kl``; returns CP-local (advantages, returns).

    ``all_gather(x)`` must return the equally shaped tensors of every CP rank in rank order
    (needed when ``cp_size > 1``).
    """
    n = len(values)
    for name, seq in (("kl", kl), ("rewards", rewards), ("loss_masks", loss_masks),
                      ("total_lengths", total_lengths), ("response_lengths", response_lengths)):
        if len(seq) != n:
            raise ValueError(f"sao_gae: {name} has {len(seq)} entries, values has {n}")
    full_v = cp_full_vectors(values, total_lengths, response_lengths, cp_rank, cp_size, all_gather)
    full_kl = cp_full_vectors(kl, total_lengths, response_lengths, cp_rank, cp_size, all_gather)
    masks = []
    for i, (m, v) in enumerate(zip(loss_masks, full_v, strict=True)):
        m = torch.as_tensor(m).to(v.device)
        if m.shape != v.shape:
            raise ValueError(
                f"sample {i}: loss_mask has {tuple(m.shape)} entries, the gathered values {tuple(v.shape)}; "
                "loss_masks must be full response length"
            )
        masks.append(m)
    token_rewards = [k.to(torch.float32) * -float(kl_coef) for k in full_kl]
    per_token = terminal_rewards_on_last_action([float(r) for r in rewards], masks, token_rewards)
    adv, ret = skip_observation_gae([v.to(torch.float32) for v in full_v], per_token, masks, gamma, lambdas)
    if cp_size > 1:
        shapes = list(zip(total_lengths, response_lengths, strict=True))
        adv = [cp_slice(a, cp_rank, cp_size, t, r) for a, (t, r) in zip(adv, shapes, strict=True)]
        ret = [cp_slice(x, cp_rank, cp_size, t, r) for x, (t, r) in zip(ret, shapes, strict=True)]
    return adv, ret


def skip_observation_advantages(args: Any, rollout_data: dict) -> None:
    """Advantage chain, order 100: sets ``advantages``, ``returns`` and ``gae_lambdas``."""
    from slime_ascend.plugins import patch_plan, runtime
    from slime_ascend.plugins.roles import in_critic_pass

    settings = runtime.settings(args, PLUGIN_NAME)
    values = rollout_data.get("values")
    if values is None:
        raise ValueError(
            "sao: rollout_data has no critic 'values'. Fix: launch with --advantage-estimator ppo so slime creates "
            "the critic (and do not train the actor before the critic's first pass)"
        )
    critic = in_critic_pass()
    if not critic and not patch_plan.applied("train.critic_advantage_function"):
        raise RuntimeError(
            "sao: the runtime patch train.critic_advantage_function is not installed in this process, so the critic "
            "cannot be told apart from the actor. Fix: enable sao in SLIME_ASCEND_PLUGINS (exported to the driver "
            "and to `ray start`), so slime-ascend installs it as each train actor starts"
        )
    masks = rollout_data["loss_masks"]
    if critic:
        lambdas = [float(settings.critic_lambda)] * len(values)
    else:
        lambdas = policy_lambdas(masks, float(settings.lambda_alpha), rollout_data.get("rollout_trainable_tokens"))
    cp_rank, cp_size, gather = cp_state()
    adv, ret = sao_gae(
        values, rollout_data["kl"], rollout_data["rewards"], masks,
        rollout_data["total_lengths"], rollout_data["response_lengths"],
        gamma=float(settings.gamma), lambdas=lambdas, kl_coef=float(getattr(args, "kl_coef", 0.0) or 0.0),
        cp_rank=cp_rank, cp_size=cp_size, all_gather=gather,
    )
    rollout_data["advantages"], rollout_data["returns"] = adv, ret  # float32, like slime's GAE
    rollout_data["gae_lambdas"] = lambdas

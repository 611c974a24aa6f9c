"""The advantage base every plugin shares: the two estimators a plugin's advantage chain starts from.

slime calls the advantage chain (:func:`slime_ascend.hooks.advantage_function`) on the last pipeline
stage of the actor and of the critic with this data-parallel rank's ``rollout_data``: ``values`` and
``kl`` are CP-local (zig-zag), ``loss_masks`` full length, ``rewards`` one scalar per sample.

* :func:`skip_observation_advantages`: skip-observation GAE on ``rollout_data``, correct under context
  parallelism (:func:`~slime_ascend.algorithms.gae.cp_skip_observation_gae`: one all-gather per tensor
  kind, GAE on full sequences, re-sliced to this rank's layout). Rewards per token ``-kl_coef * kl`` plus
  the scalar reward on the last *action* token. The caller chooses gamma and the per-sample lambdas
  (sao: length-adaptive or the critic's, sao's gamma; compaction: one per rollout, slime's ``--gamma``); both
  are stored, one per sample, in ``rollout_data["gae_lambdas"]`` and ``["gae_gammas"]`` for later chain
  steps (compaction's decay continues this GAE across segments with ``gamma * lambda``).
* :func:`slime_estimator`: slime's own ``compute_advantages_and_returns`` for ``args.advantage_estimator``,
  without the custom hook (that is us), OPD and advantage whitening (slime applies those after the custom
  function returns). The dispatcher runs it once, at the advantage slot's ``base_order``, when no
  contribution before it set ``advantages``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from slime_ascend.algorithms.gae import cp_skip_observation_gae
from slime_ascend.megatron_state import cp_state

__all__ = ["skip_observation_advantages", "slime_estimator"]


def skip_observation_advantages(
    args: Any, rollout_data: dict, *, gamma: float, lambdas: Sequence[float], plugin: str
) -> None:
    """Set ``advantages``, ``returns`` (float32, like slime's GAE), ``gae_lambdas``, ``gae_gammas``."""
    values = rollout_data.get("values")
    if values is None:
        raise ValueError(
            f"{plugin}: rollout_data has no critic 'values'. Fix: launch with --advantage-estimator ppo so slime "
            "creates the critic (and do not train the actor before the critic's first pass)"
        )
    lambdas = [float(v) for v in lambdas]
    cp_rank, cp_size, gather = cp_state()
    adv, ret = cp_skip_observation_gae(
        values, rollout_data["kl"], rollout_data["rewards"], rollout_data["loss_masks"],
        rollout_data["total_lengths"], rollout_data["response_lengths"],
        gamma=float(gamma), lambdas=lambdas, kl_coef=float(getattr(args, "kl_coef", 0.0) or 0.0),
        cp_rank=cp_rank, cp_size=cp_size, all_gather=gather,
    )
    rollout_data["advantages"], rollout_data["returns"] = adv, ret
    rollout_data["gae_lambdas"] = lambdas
    rollout_data["gae_gammas"] = [float(gamma)] * len(lambdas)


GRPO_LIKE = ("grpo", "gspo", "cispo")


def slime_estimator(args: Any, rollout_data: dict) -> None:
    """slime's estimator for ``args.advantage_estimator`` (see the module doc); sets advantages and returns.

    Without slime (plain CPU tests, the embedded demo) only the GRPO family is available: slime's
    ``get_grpo_returns`` puts the scalar reward on every token.
    """
    try:
        from slime.backends.megatron_utils.loss import compute_advantages_and_returns
    except ImportError:
        compute_advantages_and_returns = None
    if compute_advantages_and_returns is not None:
        base = copy.copy(args)
        base.custom_advantage_function_path = None
        base.use_opd = False
        base.normalize_advantages = False
        compute_advantages_and_returns(base, rollout_data)
        return
    estimator = getattr(args, "advantage_estimator", None)
    if estimator not in GRPO_LIKE:
        raise ValueError(f"the {estimator!r} base estimator needs slime importable (only {GRPO_LIKE} run without)")
    adv = [torch.ones_like(k, dtype=torch.float32) * float(r)
           for r, k in zip(rollout_data["rewards"], rollout_data["kl"], strict=True)]
    rollout_data["advantages"], rollout_data["returns"] = adv, list(adv)

"""The advantage bases plugins share (slime-facing; the pure algorithm is in :mod:`~slime_ascend.algorithms.gae`).

* :func:`skip_observation_advantages`: skip-observation GAE on this DP rank's ``rollout_data`` (``values``
  and ``kl`` CP-local, ``loss_masks`` full length, one scalar reward per sample), correct under context
  parallelism (:func:`~slime_ascend.algorithms.gae.cp_skip_observation_gae`). The caller picks gamma and
  the per-sample lambdas (sao: length-adaptive or the critic's; compaction: one per rollout); both are
  stored in ``rollout_data["gae_gammas"]`` / ``["gae_lambdas"]`` for compaction's decay, which continues
  this GAE across segments.
* :func:`slime_estimator`: slime's own ``compute_advantages_and_returns`` without the custom hook (us),
  OPD and whitening (slime applies those after the custom function returns). The advantage dispatcher
  runs it once, at the chain's ``base_order``, when no plugin computed a base.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

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


def slime_estimator(args: Any, rollout_data: dict) -> None:
    """slime's estimator for ``args.advantage_estimator`` (see the module doc); sets advantages and returns."""
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns

    base = copy.copy(args)
    base.custom_advantage_function_path = None
    base.use_opd = False
    base.normalize_advantages = False
    compute_advantages_and_returns(base, rollout_data)

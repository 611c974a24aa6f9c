"""SAO skip-observation GAE as slime's advantage hook (the shared
:func:`~slime_ascend.advantage_base.skip_observation_advantages`, correct under context parallelism).

Lambda: in the actor, ``1 - 1 / (alpha * l)`` per rollout, ``l`` = the rollout's trainable tokens
(``rollout_data["rollout_trainable_tokens"]`` when the compaction plugin provides rollout totals,
else the sample's own loss-mask sum); in the critic, ``ascend_sao_critic_lambda`` (1). The critic is
recognised by the ``train.critic_advantage_function`` patch
(:func:`~slime_ascend.plugins.roles.in_critic_pass`). The lambdas used are stored in
``rollout_data["gae_lambdas"]`` for later chain steps (compaction decay).
"""

from __future__ import annotations

from typing import Any

from slime_ascend.advantage_base import skip_observation_advantages as _skip_observation_gae
from slime_ascend.algorithms.gae import length_adaptive_lambdas

__all__ = ["skip_observation_advantages"]

PLUGIN_NAME = "sao"


def skip_observation_advantages(args: Any, rollout_data: dict) -> None:
    """Advantage chain, order 100: sets ``advantages``, ``returns`` and ``gae_lambdas``."""
    from slime_ascend.plugins import runtime
    from slime_ascend.plugins.roles import in_critic_pass
    from slime_ascend.startup import patch_plan

    settings = runtime.settings(args, PLUGIN_NAME)
    critic = in_critic_pass()
    if not critic and not patch_plan.applied("train.critic_advantage_function"):
        raise RuntimeError(
            "sao: the runtime patch train.critic_advantage_function is not installed in this process, so the critic "
            "cannot be told apart from the actor. Fix: enable sao in SLIME_ASCEND_PLUGINS (exported to the driver "
            "and to `ray start`), so slime-ascend installs it as each train actor starts"
        )
    masks = rollout_data["loss_masks"]
    if critic:
        lambdas = [float(settings.critic_lambda)] * len(masks)
    else:
        lambdas = length_adaptive_lambdas(masks, float(settings.lambda_alpha),
                                          rollout_data.get("rollout_trainable_tokens"))
    _skip_observation_gae(args, rollout_data, gamma=float(settings.gamma), lambdas=lambdas, plugin=PLUGIN_NAME)

"""Declaration of the ``sync-cadence`` plugin (cheap to import)."""

from __future__ import annotations

from typing import Any

from ..plugins.base import PatchUse, Plugin
from ..plugins.settings import Setting, SettingsError, read

RESET_ARG = "ascend_sync_reset_optimizer_on_push"
RESET = Setting(RESET_ARG, bool, True,
                "after each weight push to the rollout engines, zero the actor optimizer's step and every state "
                "tensor (Adam's moments, SGD's momentum; slime's --reset-optimizer-states resets at every rollout "
                "instead)")


def validate(args: Any, settings: Any) -> None:
    if settings.reset_optimizer_on_push and getattr(args, "reset_optimizer_states", False):
        raise SettingsError("sync-cadence: ascend_sync_reset_optimizer_on_push and --reset-optimizer-states both reset "
                            "the optimizer (slime's at every rollout). Fix: drop --reset-optimizer-states")


def resets(args: Any) -> bool:
    """Condition of ``train.reset_optimizer_on_push``: the coerced setting (a YAML ``"false"`` is False)."""
    return read(RESET, args)


PLUGIN = Plugin(
    name="sync-cadence",
    description="GLM-5's weight-push cadence: push every K updates (slime's --update-weights-interval K with "
                "train_async.py) and reset the optimizer after each push",
    settings=(RESET,),
    patches=(PatchUse("train.reset_optimizer_on_push", "train", when="slime_ascend.sync_cadence.plugin.resets"),),
    validate="slime_ascend.sync_cadence.plugin.validate",
)

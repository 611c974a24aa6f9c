"""The actor's optimizer is reset after each weight push (GLM-5's cadence), not at every rollout.

GLM-5 pushes weights every K updates (slime's ``--update-weights-interval K`` with ``train_async.py``) and resets
the optimizer after each push, so the policy that generates is always trained from fresh moments. The reset is
:func:`slime_ascend.sync_cadence.optimizer.reset_optimizer_states`, the operations of slime's own reset.
Nothing trains between a push and the next ``train`` call, so this is the reset after the push. Why not wrap
``MegatronTrainRayActor.update_weights``: Ray captures an actor's methods when the worker loads the class,
so a method patched as ``init`` runs never sees a remote call; the updaters and ``train`` (the name
``slime.backends.megatron_utils.actor`` imported from ``model.py``) are looked up at each call.
"""

from __future__ import annotations

import functools
import logging
import threading
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, param_mismatch
from ._updaters import UPDATERS, updater_classes

logger = logging.getLogger("slime_ascend.sync_cadence")
ACTOR = "slime.backends.megatron_utils.actor"

_lock = threading.Lock()
_state = {"pushes": 0, "pending": False}


def _wrap_update(original):
    @functools.wraps(original)
    def update_weights(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        with _lock:
            _state["pushes"] += 1
            _state["pending"] = True
        return result

    return update_weights


def _wrap_train(original):
    @functools.wraps(original)
    def train(rollout_id, model, optimizer, opt_param_scheduler, *args, **kwargs):
        with _lock:
            pending, push = _state["pending"], _state["pushes"]
            _state["pending"] = False
        if pending and optimizer is not None:
            from ...sync_cadence.optimizer import reset_optimizer_states

            states = reset_optimizer_states(optimizer)
            logger.info("sync-cadence: optimizer states reset after weight push %d (%d parameter states), before "
                        "training rollout %s", push, states, rollout_id)
        return original(rollout_id, model, optimizer, opt_param_scheduler, *args, **kwargs)

    return train


class ResetOptimizerOnPush(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        problems = missing_attrs(modules[ACTOR], ["train"])
        if not problems:
            problems += param_mismatch(modules[ACTOR].train, ["rollout_id", "model", "optimizer", "opt_param_scheduler"],
                                       "train")
        for module_name, cls_name in UPDATERS.items():
            problems += missing_attrs(modules[module_name], [f"{cls_name}.update_weights"])
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        for cls in updater_classes(modules):
            if "update_weights" in vars(cls):
                self.wrap(cls, "update_weights", _wrap_update)
        self.wrap(modules[ACTOR], "train", _wrap_train)


def reset_state() -> None:
    """Forget pushes (tests)."""
    with _lock:
        _state.update(pushes=0, pending=False)


PATCH = ResetOptimizerOnPush(
    id="train.reset_optimizer_on_push",
    targets=(f"{ACTOR}:train",) + tuple(f"{m}:{c}.update_weights" for m, c in UPDATERS.items()),
    why="GLM-5 resets the optimizer after each weight push (every K updates); slime's --reset-optimizer-states "
    "resets at the start of every rollout's training.",
    how="A weight updater's update_weights marks a push; the next train() call of the process zeroes its "
    "optimizer's Adam step and moments in place first (the operations of slime's own reset).",
    upstream="patches/0014-reset-optimizer-on-weight-push.patch",
    checked_on=("0.3.1",),
)

"""The PPO critic keeps the custom advantage function and the custom loss.

slime's ``_apply_megatron_role_overrides`` (``slime/utils/arguments.py`` ~l.1673) nulls the critic's path, so
its value targets come from slime's plain GAE instead of the plugin's estimator (SAO: skip-observation GAE with
lambda 1), and ``train_critic`` (``actor.py``) always sets ``loss_type = "value_loss"``. A per-role config is the
only way to give the critic its own freeze list, learning rate or checkpoint, so the two must combine.

Restoring the path on the real ``args`` (an actor's value is left alone) is enough: slime's
``compute_advantages_and_returns`` reads it at call time. The critic pass (:func:`in_critic_pass`) lets the
advantage function and the loss know the role. ``train_critic`` is wrapped on the Ray actor class too
(:func:`with_ray_actor_classes`): Ray copies every method onto its own subclass when the worker loads the class,
before ``init`` (and so this patch) runs. The value loss is routed only while ``custom_loss_function_path`` is
set (our dispatcher); otherwise slime's own value loss runs.

Upstream (patches/0003-critic-train-iters.patch): stop nulling the critic's custom advantage function
(or add ``--critic-custom-advantage-function-path``) and pass the role to the hooks.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ...plugins.roles import critic_pass, in_critic_pass
from ..base import RuntimePatch, missing_attrs, missing_source, param_mismatch

ACTOR = "slime.backends.megatron_utils.actor"
LOSS = "slime.backends.megatron_utils.loss"
DISPATCHER = "slime_ascend.hooks.advantage_function"
ARGS_KEY = "custom_advantage_function_path"

def _wrap_train_critic(original):
    @functools.wraps(original)
    def train_critic(self, rollout_id, rollout_data, *args, **kwargs):
        with critic_pass():
            return original(self, rollout_id, rollout_data, *args, **kwargs)

    return train_critic


def with_ray_actor_classes(cls: type, method: str) -> list[type]:
    """``cls`` and every subclass that holds its own ``method``: the classes whose ``method`` an instance uses.

    Ray's worker turns an actor class into a subclass and copies every method onto it (wrapped in a
    tracing span that holds the original function), before the actor's ``init`` runs. A method
    patched afterwards on ``cls`` alone never reaches the live actor; it must be patched on that
    subclass too.
    """
    out, stack = [cls], list(cls.__subclasses__())
    while stack:
        sub = stack.pop()
        stack.extend(sub.__subclasses__())
        if method in vars(sub) and sub not in out:
            out.append(sub)
    return out


def _wrap_value_loss(original):
    @functools.wraps(original)
    def value_loss_function(args, batch, logits, sum_of_sample_mean):
        path = getattr(args, "custom_loss_function_path", None)
        if in_critic_pass() and path:
            from slime.utils.misc import load_function

            return load_function(path)(args, batch, logits, sum_of_sample_mean)
        return original(args, batch, logits, sum_of_sample_mean)

    return value_loss_function


class CriticAdvantageFunction(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        problems: list[str] = []
        actor, loss = modules.get(ACTOR), modules.get(LOSS)
        if actor is not None:
            problems += missing_attrs(actor, ["MegatronTrainRayActor.train_critic"])
            if not problems:
                fn = actor.MegatronTrainRayActor.train_critic
                problems += param_mismatch(fn, ["self", "rollout_id", "rollout_data"], "train_critic")
                problems += missing_source(fn, ["compute_advantages_and_returns(self.args", 'loss_type = "value_loss"'],
                                           "train_critic")
        if loss is not None:
            found = missing_attrs(loss, ["compute_advantages_and_returns", "value_loss_function", "loss_function"])
            problems += found
            if not found:
                problems += missing_source(loss.compute_advantages_and_returns,
                                           ["args.custom_advantage_function_path"], "compute_advantages_and_returns")
                problems += missing_source(loss.loss_function, ["func = value_loss_function"], "loss_function")
                problems += param_mismatch(loss.value_loss_function,
                                           ["args", "batch", "logits", "sum_of_sample_mean"], "value_loss_function")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        if args is not None and getattr(args, ARGS_KEY, None) is None:
            self.replace(args, ARGS_KEY, DISPATCHER)
        if ACTOR in modules:
            for owner in with_ray_actor_classes(modules[ACTOR].MegatronTrainRayActor, "train_critic"):
                self.wrap(owner, "train_critic", _wrap_train_critic)
        if LOSS in modules:
            self.wrap(modules[LOSS], "value_loss_function", _wrap_value_loss)


PATCH = CriticAdvantageFunction(
    id="train.critic_advantage_function",
    targets=(
        f"{ACTOR}:MegatronTrainRayActor.train_critic",
        f"{LOSS}:value_loss_function",
        f"{LOSS}:compute_advantages_and_returns",
    ),
    why="--megatron-config-path nulls the critic's custom_advantage_function_path and the critic always uses "
        "slime's value loss, so a plugin's GAE and loss never reach the critic.",
    how="Restore args.custom_advantage_function_path to our dispatcher where it is None; mark train_critic as a "
        "critic pass; route value_loss_function to custom_loss_function_path during critic passes.",
    upstream="patches/0003-critic-train-iters.patch",
    checked_on=("0.3.1",),
)

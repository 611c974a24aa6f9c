"""K value-loss passes of the PPO critic per rollout (upstream flag proposal ``--critic-train-iters``).

slime's ``train_critic`` (``slime/backends/megatron_utils/actor.py`` ~l.396-422) computes the critic's values
and targets once, then runs one ``train(...)`` pass; SAO's faster value update (TTUR) wants K = 2. The ``train``
wrapped is the name ``actor.py`` imported from ``model.py``; it resets the data iterators itself, and
``train_actor`` is unaffected. ``train_critic`` is wrapped on the Ray actor class as well: Ray copies the methods
onto its own subclass when the worker loads the class, before ``init`` installs this patch. The values returned
to the actor are the pre-update ones, as in slime; value clipping is relative to them in every pass, and the
targets are those of this rollout.

K is read at call time (``args.critic_train_iters`` missing: 1). The learning-rate / weight-decay schedule:

* ``"per_rollout"`` (default): the scheduler advances in the first pass only; later passes call it
  with ``increment=0`` (the rate is re-read, unchanged). The critic's schedule then counts the same
  optimizer steps as the actor's: ``lr_warmup_iters`` / ``lr_decay_iters`` mean policy steps, and a
  resumed checkpoint's scheduler position matches the rollout count.
* ``"per_pass"``: every pass advances it (K times per rollout); scale the critic's warm-up and decay
  iterations by K yourself.

Upstream: patches/0003-critic-train-iters.patch (the loop in ``train_critic``).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
from types import ModuleType
from typing import Any

from ...plugins.roles import CRITIC_ITERS_ARG as ITERS_KEY
from ...plugins.roles import CRITIC_SCHEDULE_ARG as SCHEDULE_KEY
from ..base import RuntimePatch, missing_attrs, missing_source, param_mismatch

ACTOR = "slime.backends.megatron_utils.actor"
SCHEDULES = ("per_rollout", "per_pass")


@dataclasses.dataclass
class _Plan:
    iters: int
    schedule: str
    passes: int = 0  # passes run so far in this train_critic call


_PLAN: contextvars.ContextVar[_Plan | None] = contextvars.ContextVar("slime_ascend_critic_plan", default=None)
#: passes run by the most recent ``train_critic`` call in this process (for logs and tests)
last_passes: int = 0


def plan_from_args(args: Any) -> tuple[int, str]:
    """(K, schedule) from ``args``; raises ValueError naming the key on bad values."""
    raw = getattr(args, ITERS_KEY, None)
    iters = 1 if raw is None else raw
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"args.{ITERS_KEY} must be an integer >= 1, got {raw!r}")
    schedule = getattr(args, SCHEDULE_KEY, None) or "per_rollout"
    if schedule not in SCHEDULES:
        raise ValueError(f"args.{SCHEDULE_KEY} must be one of {SCHEDULES}, got {schedule!r}")
    return iters, schedule


class HeldSchedule:
    """A view of an ``OptimizerParamScheduler`` whose ``step`` does not advance it (increment 0)."""

    def __init__(self, scheduler: Any):
        self._scheduler = scheduler

    def step(self, increment: Any = None, *args: Any, **kwargs: Any) -> Any:
        return self._scheduler.step(increment=0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)


def _wrap_train_critic(original):
    @functools.wraps(original)
    def train_critic(self, rollout_id, rollout_data, *args, **kwargs):
        global last_passes
        iters, schedule = plan_from_args(self.args)
        plan = _Plan(iters, schedule)
        token = _PLAN.set(plan)
        try:
            result = original(self, rollout_id, rollout_data, *args, **kwargs)
        finally:
            _PLAN.reset(token)
            last_passes = plan.passes
        if plan.passes != iters:
            raise RuntimeError(
                f"train.critic_train_iters: train_critic ran {plan.passes} value-loss passes, expected {iters}; "
                "slime's train_critic no longer calls actor.train once"
            )
        return result

    return train_critic


def _wrap_train(original):
    @functools.wraps(original)
    def train(rollout_id, model, optimizer, opt_param_scheduler, *args, **kwargs):
        plan = _PLAN.get()
        if plan is None:  # the actor's train, or a call outside train_critic
            return original(rollout_id, model, optimizer, opt_param_scheduler, *args, **kwargs)
        if plan.passes:
            raise RuntimeError("train.critic_train_iters: train_critic called train twice; the patch expects one call")
        result = None
        for k in range(plan.iters):
            scheduler = opt_param_scheduler
            if k > 0 and plan.schedule == "per_rollout" and opt_param_scheduler is not None:
                scheduler = HeldSchedule(opt_param_scheduler)
            result = original(rollout_id, model, optimizer, scheduler, *args, **kwargs)
            plan.passes += 1
        return result

    return train


class CriticTrainIters(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        actor = modules.get(ACTOR)
        if actor is None:
            return []
        problems = missing_attrs(actor, ["MegatronTrainRayActor.train_critic", "train"])
        if problems:
            return problems
        fn = actor.MegatronTrainRayActor.train_critic
        problems += param_mismatch(fn, ["self", "rollout_id", "rollout_data"], "train_critic")
        problems += missing_source(fn, ["forward_only(get_values", "compute_advantages_and_returns(", "train(",
                                        "self.opt_param_scheduler"], "train_critic")
        try:
            if ITERS_KEY in inspect.getsource(fn):
                problems.append(f"train_critic already reads {ITERS_KEY} (upstream patch merged): drop this patch")
        except (OSError, TypeError):
            pass
        problems += param_mismatch(actor.train, ["rollout_id", "model", "optimizer", "opt_param_scheduler"], "train")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        if args is not None:
            plan_from_args(args)  # fail at start on bad values
        from .critic_advantage_function import with_ray_actor_classes

        actor = modules[ACTOR]
        # Ray's actor class (a subclass holding copies of the methods) is what the live actor calls
        for owner in with_ray_actor_classes(actor.MegatronTrainRayActor, "train_critic"):
            self.wrap(owner, "train_critic", _wrap_train_critic)
        self.wrap(actor, "train", _wrap_train)


PATCH = CriticTrainIters(
    id="train.critic_train_iters",
    targets=(f"{ACTOR}:MegatronTrainRayActor.train_critic", f"{ACTOR}:train"),
    why="SAO trains the critic K times per policy update (faster value update); slime runs one value-loss pass.",
    how="Wrap train_critic to announce K (args.critic_train_iters) and the actor module's train to run K passes "
        "on the same data while announced; the LR schedule advances once per rollout unless "
        "args.critic_train_iters_lr_schedule == 'per_pass'.",
    upstream="patches/0003-critic-train-iters.patch",
    checked_on=("0.3.1",),
)

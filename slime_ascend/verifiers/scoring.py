"""How the gate scores a case: exactly as training would score it.

* An environment (compaction's protocol: ``reset(seed, task)``, ``step(action) -> StepResult``) is played action by
  action: the reward of the step that ends the episode (``None`` counts 0.0). No reward is made up by the harness: a
  run whose actions end before the episode does gets what the environment itself says of the episode as it stands
  (its ``episode_reward()`` where it has one, else the last reward a step reported, else None), so an environment
  that pays along the way fails the ``unfinished`` check. A run marked ``until_done`` (the gate marks every
  ``no_action`` run) goes on repeating its last action (the no-op) until the episode ends or the environment's turn
  limit (``max_turns`` where it declares one, else :data:`MAX_NOOP_TURNS` steps): an environment that pays for
  reaching its turn limit, however the agent got there, fails the ``no_action`` check.
* A reward function is called with slime's ``(args, sample)`` (awaited when it is a coroutine function) on a
  ``Sample`` built from a :class:`~.gate.SampleRun`: slime's own ``Sample`` where slime imports, else a stand-in
  with the same fields.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable
from enum import Enum
from types import SimpleNamespace
from typing import Any

from .gate import EnvRun, SampleRun, VerifierGateError


MAX_NOOP_TURNS = 256  # a no-op run's turns where the environment declares no max_turns (the gate is bounded)


def _turn_limit(env: Any) -> int:
    limit = getattr(env, "max_turns", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else MAX_NOOP_TURNS


def env_scorer(factory: Callable[[], Any]) -> Callable[[EnvRun], float | None]:
    def score(run: EnvRun) -> float | None:
        if not isinstance(run, EnvRun):
            raise VerifierGateError(f"an environment is scored on EnvRun cases, got {type(run).__name__}")
        env = factory()
        env.reset(seed=run.seed, task=run.task)
        actions = list(run.actions)
        if run.until_done:  # the no-op repeated to the end of the episode or to the turn limit
            noop = actions[-1] if actions else ""
            actions += [noop] * max(0, _turn_limit(env) - len(actions))
        last = None
        for action in actions:
            step = env.step(action)
            if step.done:
                return 0.0 if step.reward is None else float(step.reward)
            last = step.reward if step.reward is not None else last
        as_it_stands = getattr(env, "episode_reward", None)
        return as_it_stands() if callable(as_it_stands) else last

    return score


class _Status(Enum):  # slime's Sample.Status values, for hosts without slime
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


def make_sample(run: SampleRun, index: int = 0) -> Any:
    try:
        from slime.utils.types import Sample
    except ImportError:
        Sample = None
    if Sample is not None:
        sample = Sample(index=index, group_index=index, prompt=run.prompt, response=run.response, label=run.label,
                        metadata=dict(run.metadata))
        status_cls = Sample.Status
    else:
        sample = SimpleNamespace(index=index, group_index=index, prompt=run.prompt, response=run.response,
                                 label=run.label, metadata=dict(run.metadata), tokens=[], reward=None,
                                 loss_mask=None, rollout_log_probs=None, weight_versions=[], train_metadata=None)
        status_cls = _Status
    try:
        sample.status = status_cls(run.status)
    except ValueError:
        raise VerifierGateError(f"SampleRun.status {run.status!r} is not one of "
                                f"{[s.value for s in status_cls]}") from None
    sample.response_length = len(run.response) if run.response_length is None else int(run.response_length)
    return sample


def preload(module: str) -> None:
    """Import ``module`` now if it imports (a scoring call's deadline must not pay for slime's first import)."""
    try:
        importlib.import_module(module)
    except ImportError:
        pass


def reward_fn_scorer(fn: Callable[..., Any], args: Any) -> Callable[[SampleRun], float | None]:
    preload("slime.utils.types")  # make_sample's Sample

    def score(run: SampleRun) -> float | None:
        if not isinstance(run, SampleRun):
            raise VerifierGateError(f"a reward function is scored on SampleRun cases, got {type(run).__name__}")
        value = fn(args, make_sample(run))
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        if isinstance(value, dict):  # slime's rewards may be dicts; the gate needs slime's --reward-key value
            key = getattr(args, "reward_key", None)
            if key is None or key not in value:
                raise VerifierGateError(f"the reward function returned a dict without --reward-key {key!r}")
            value = value[key]
        if isinstance(value, bool):
            value = float(value)
        if value is not None and not isinstance(value, (int, float)):
            raise VerifierGateError(f"the reward function returned {type(value).__name__}, not a number")
        return value

    return score


async def _awaited(value):
    return await value

"""The role this process plays in slime's loop: state that features and runtime patches share.

Features read it, patches set it; neither imports the other, so a patch can be deleted when upstream
merges its fix without touching the features that relied on it. The role-entry patches report here where a
role first holds slime's args (:func:`entered`); the runtime says what then runs (:func:`on_entry`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

#: slime args that carry the critic's passes per rollout and their LR schedule (upstream patch 0003's names)
CRITIC_ITERS_ARG = "critic_train_iters"
CRITIC_SCHEDULE_ARG = "critic_train_iters_lr_schedule"

_train_role: str | None = None
_entry: Callable[[Any, str], None] | None = None
_CRITIC_PASS: contextvars.ContextVar[bool] = contextvars.ContextVar("slime_ascend_critic_pass", default=False)


def set_train_role(role: str | None) -> None:
    """Record this process's Megatron role (slime's ``TrainRayActor.init(args, role)``)."""
    global _train_role
    _train_role = role if isinstance(role, str) else None


def train_role() -> str | None:
    """``"actor"`` or ``"critic"`` in a slime train actor (once its ``init`` started), else ``None``.

    slime gives the critic its own args (``_apply_megatron_role_overrides``: ``use_opd``, ``kl_coef``
    and ``custom_advantage_function_path`` switched off), so a plugin checking actor-only settings
    skips them in the critic."""
    return _train_role


def on_entry(handler: Callable[[Any, str], None]) -> None:
    """Set what runs where a role first holds slime's args (the runtime's validation,
    :func:`slime_ascend.startup.early.entered`)."""
    global _entry
    _entry = handler


def entered(args: Any, role: str) -> None:
    """Called by the role-entry patches (``driver.validate_at_parse_args``, ``rollout.validate_at_http_client``,
    ``train.validate_at_actor_init``) where ``role`` (driver, rollout, train) first holds ``args``."""
    if _entry is None:
        raise RuntimeError("a role-entry patch is installed but the runtime set no handler "
                           "(install it through slime_ascend.startup.early.install)")
    _entry(args, role)


def in_critic_pass() -> bool:
    """True while slime's ``MegatronTrainRayActor.train_critic`` runs in this process (marked by the
    ``train.critic_advantage_function`` patch)."""
    return _CRITIC_PASS.get()


@contextlib.contextmanager
def critic_pass() -> Iterator[None]:
    """Mark the enclosed code as the critic's pass (what the ``train_critic`` wrapper does)."""
    token = _CRITIC_PASS.set(True)
    try:
        yield
    finally:
        _CRITIC_PASS.reset(token)

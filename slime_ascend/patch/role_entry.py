"""Role-entry patches: where each slime role first holds the final ``args``, slime-ascend validates its plugins.

slime has no hook there (upstream proposal ``patches/0016-role-entry-hook.patch``), so three ledger patches wrap
the slime function that receives (or returns) ``args`` early in each role and call
:func:`slime_ascend.plugins.roles.entered` (what runs then is the runtime's, :mod:`slime_ascend.startup.early`):
``driver.validate_at_parse_args``, ``rollout.validate_at_http_client``, ``train.validate_at_actor_init``. The
train one also records the actor's Megatron role first and, after ``init``, logs the device slime selected.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from types import ModuleType
from typing import Any

from ..plugins import roles
from .base import RuntimePatch, missing_attrs, missing_source, param_mismatch

UPSTREAM = "patches/0016-role-entry-hook.patch"


@dataclasses.dataclass
class RoleEntry(RuntimePatch):
    """Wrap ``targets[0]`` (``module:attr`` or ``module:Class.method``) to call ``roles.entered(args, role)``.

    ``args_at``: the position of ``args`` in the call (also taken by the keyword ``args``); None: ``args`` is
    the function's result, validated after it returns. ``params`` / ``source``: what the target must take and
    contain (its check)."""

    role: str = ""
    args_at: int | None = None
    params: tuple[str, ...] = ()
    source: tuple[str, ...] = ()

    @property
    def _module_attr(self) -> tuple[str, str]:
        module, _, attr = self.targets[0].partition(":")
        return module, attr

    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        name, attr = self._module_attr
        module = modules[name]
        problems = missing_attrs(module, [attr])
        if problems:
            return problems
        fn = functools.reduce(getattr, attr.split("."), module)
        label = f"{name}.{attr}"
        return param_mismatch(fn, self.params, label) + missing_source(fn, self.source, label)

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        name, attr = self._module_attr
        *owner_path, method = attr.split(".")
        owner = functools.reduce(getattr, owner_path, modules[name])
        self.wrap(owner, method, self._wrapper)

    def _wrapper(self, fn):
        role, at = self.role, self.args_at

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            if at is None:
                result = fn(*a, **kw)
                roles.entered(result, role)
                return result
            args = a[at] if len(a) > at else kw.get("args")
            if role == "train":  # TrainRayActor.init(self, args, role, ...): "actor" or "critic"
                roles.set_train_role(a[at + 1] if len(a) > at + 1 else kw.get("role"))
            if args is not None:
                roles.entered(args, role)
            result = fn(*a, **kw)
            if role == "train":
                report_device()
            return result

        return wrapper


def report_device() -> None:
    """One line per train actor: the backend slime's registry selected and the device Ray gave it, the
    first thing to read when a job lands on the wrong device or transport."""
    try:
        from slime.utils import accelerator
        from slime.utils.accelerator import get_accelerator

        acc = get_accelerator()
        env = acc.visible_devices_env
        backend = accelerator.process_group_backend()
    except Exception:  # noqa: BLE001 - a report, never a reason to fail the actor
        return
    from ..plugins import runtime

    runtime.logger.info(
        "slime accelerator in the %s train actor: %s (process groups %s, %s=%s, LOCAL_RANK=%s)",
        roles.train_role() or "?", acc.name, backend, env, os.environ.get(env, ""), os.environ.get("LOCAL_RANK", ""))

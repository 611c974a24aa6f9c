"""Validate the enabled plugins as soon as a process holds slime's ``args``, not at the first hook call.

The bootstrap (:mod:`slime_ascend._bootstrap`) installs these wrappers through import hooks, so
they cost nothing in a process that never imports slime. Each wraps a slime function that receives
(or returns) the final ``args`` early in one role:

=============  =====================================================  ==================================
role           slime function                                         when
=============  =====================================================  ==================================
driver         ``slime.utils.arguments.parse_args`` (its result)       right after the YAML is applied
rollout        ``slime.utils.http_utils.init_http_client(args)``       first line of ``RolloutManager``
train          ``slime.ray.train_actor.TrainRayActor.init(args, ..)``  before the process group and model
=============  =====================================================  ==================================

The check is :func:`slime_ascend.plugins.runtime.active` (cached, so the dispatchers do not repeat
it); in the train and rollout roles the enabled plugins' patches for that role are installed next
(:mod:`slime_ascend.plugins.patch_plan`). In the driver a failure is one line on stderr and exit status 2, as argparse does for a bad
flag; in a Ray actor it is raised, and Ray reports it as the actor's creation error. A slime
without one of these functions just keeps the first-use check of the hook dispatchers.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

ARGUMENTS = "slime.utils.arguments"
HTTP_UTILS = "slime.utils.http_utils"
TRAIN_ACTOR = "slime.ray.train_actor"

_lock = threading.Lock()
_installed = False


def validate_now(args: Any, role: str) -> None:
    """Validate ``args`` for this process (``role``: driver, rollout, train) and install the enabled
    plugins' patches declared for that role (:mod:`.patch_plan`); raises PluginError or SettingsError
    (see module doc)."""
    from .. import _bootstrap
    from . import patch_plan, runtime

    _bootstrap.raise_activation_error(f" in the {role} process")
    state = runtime.active(args)
    if role in ("train", "rollout"):
        patch_plan.install_for_role(args, role, state.selection.plugins)


def _driver_parse_args(parse_args):
    @functools.wraps(parse_args)
    def wrapper(*a, **kw):
        args = parse_args(*a, **kw)
        from .registry import PluginError
        from .settings import SettingsError

        try:
            validate_now(args, "driver")
        except (PluginError, SettingsError) as exc:
            print(f"slime-ascend: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        return args

    wrapper.__slime_ascend_early__ = True
    return wrapper


def _args_at(role: str, position: int):
    def make(fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            args = a[position] if len(a) > position else kw.get("args")
            if role == "train":  # TrainRayActor.init(self, args, role, ...): "actor" or "critic"
                from . import roles

                roles.set_train_role(a[position + 1] if len(a) > position + 1 else kw.get("role"))
            if args is not None:
                validate_now(args, role)
            result = fn(*a, **kw)
            if role == "train":
                _report_device()
            return result

        wrapper.__slime_ascend_early__ = True
        return wrapper

    return make


def _report_device() -> None:
    """One line per train actor: the backend slime's registry selected and the device Ray gave it, the
    first thing to read when a job lands on the wrong device or transport."""
    import os

    try:
        from slime.utils import accelerator
        from slime.utils.accelerator import get_accelerator

        acc = get_accelerator()
        env = acc.visible_devices_env
        backend = accelerator.process_group_backend()
    except Exception:  # noqa: BLE001 - a report, never a reason to fail the actor
        return
    from . import roles, runtime

    runtime.logger.info(
        "slime accelerator in the %s train actor: %s (process groups %s, %s=%s, LOCAL_RANK=%s)",
        roles.train_role() or "?", acc.name, backend, env, os.environ.get(env, ""), os.environ.get("LOCAL_RANK", ""))


def _wrap_attr(owner: Any, name: str, make) -> None:
    """Wrap ``owner.name`` with ``make`` once (nothing when the owner or the function is missing)."""
    fn = getattr(owner, name, None)
    if fn is not None and not getattr(fn, "__slime_ascend_early__", False):
        setattr(owner, name, make(fn))


def install() -> None:
    """Register the wrappers (once per process); each applies when slime imports its module."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    from .. import _import_hooks

    _import_hooks.when_imported(ARGUMENTS, lambda m: _wrap_attr(m, "parse_args", _driver_parse_args))
    _import_hooks.when_imported(HTTP_UTILS, lambda m: _wrap_attr(m, "init_http_client", _args_at("rollout", 0)))
    # TrainRayActor.init(self, args, role, ...)
    _import_hooks.when_imported(TRAIN_ACTOR, lambda m: _wrap_attr(getattr(m, "TrainRayActor", None), "init",
                                                                   _args_at("train", 1)))

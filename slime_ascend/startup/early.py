"""Validate the enabled plugins as soon as a process holds slime's ``args``, not at the first hook call.

Three runtime patches of the ledger (:data:`PATCHES`, :mod:`slime_ascend.patch.role_entry`) wrap the slime
function that receives (or returns) the final ``args`` early in each role, and call
:func:`slime_ascend.plugins.roles.entered`, which runs :func:`entered` here:

=============  =====================================================  ==================================
role           slime function (ledger id)                             when
=============  =====================================================  ==================================
driver         ``slime.utils.arguments.parse_args`` (its result)       right after the YAML is applied
               (``driver.validate_at_parse_args``)
rollout        ``slime.utils.http_utils.init_http_client(args)``       first line of ``RolloutManager``
               (``rollout.validate_at_http_client``)
train          ``slime.ray.train_actor.TrainRayActor.init(args, ..)``  before the process group and model
               (``train.validate_at_actor_init``)
=============  =====================================================  ==================================

The bootstrap (:mod:`.bootstrap`) registers them (:func:`install`) as import-moment patches, so they cost
nothing in a process that never imports slime; each checks its target as slime imports its module and fails
loudly (:class:`~slime_ascend.patch.PatchTargetError`) when the target no longer looks as expected.

The check is :func:`slime_ascend.plugins.runtime.active` (cached, so the dispatchers do not repeat
it); in the train and rollout roles the enabled plugins' patches for that role are installed next
(:mod:`.patch_plan`). In the driver a failure is one line on stderr and exit status 2, as argparse does for a
bad flag; in a Ray actor it is raised, and Ray reports it as the actor's creation error.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from ..command import UserError
from ..plugins import roles, runtime
from ..plugins.base import PatchUse
from ..plugins.registry import PluginError
from ..plugins.settings import SettingsError
from . import patch_plan

#: the runtime's own patches, registered in every process the bootstrap activates
PATCHES = (
    PatchUse("driver.validate_at_parse_args"),
    PatchUse("rollout.validate_at_http_client"),
    PatchUse("train.validate_at_actor_init"),
)

_lock = threading.Lock()
_installed = False


def validate_now(args: Any, role: str) -> None:
    """Validate ``args`` for this process (``role``: driver, rollout, train) and install the enabled
    plugins' patches declared for that role (:mod:`.patch_plan`); raises PluginError or SettingsError
    (see module doc)."""
    runtime.raise_activation_error(f" in the {role} process")
    state = runtime.active(args)
    if role in ("train", "rollout"):
        patch_plan.install_for_role(args, role, state.selection.plugins)


def entered(args: Any, role: str) -> None:
    """What runs where ``role`` first holds ``args`` (the role-entry patches call it through
    :func:`slime_ascend.plugins.roles.entered`)."""
    if role != "driver":
        validate_now(args, role)
        return
    try:
        validate_now(args, role)
    except (UserError, SettingsError) as exc:  # PluginError is a UserError; so is a verifier the gate refuses
        print(f"slime-ascend: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def install() -> None:
    """Register the role-entry patches (once per process); each applies when slime imports its module."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    roles.on_entry(entered)
    patch_plan.register_at_import(PATCHES)

"""Can Ray place every actor slime will ask for? Checked in the driver's ``parse_args``, before Ray starts.

On a small host slime's ``train.py`` otherwise waits for ever, silently: the local Ray cluster slime's first
Ray call starts advertises one logical CPU per core, and slime asks for more than a 2-core host has (what it
asks for, from ``slime/ray/placement_group.py`` and ``slime/ray/rollout.py``):

* one bundle of one CPU per device of its placement group (``_get_placement_group_layout``: actor devices,
  plus rollout devices unless colocated or external), the train actors and engines placed inside them;
* the ``RolloutManager`` (``num_cpus=1``) and its engine lock (``num_cpus=1``), outside the group;
* one ``SGLangEngine`` handle of 0.2 CPU per external engine (``--rollout-external-engine-addrs``).

Logical CPUs are scheduling tokens, not cores: ``RAY_OVERRIDE_RESOURCES='{"CPU": 8}'`` (or ``ray start --head
--num-cpus 8``) lets the same job start on a 2-core host. Only a cluster this process would start itself is
checked; an existing one (``RAY_ADDRESS``, a ``ray start`` cluster on this machine) keeps its own resources.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from ..plugins.settings import SettingsError

OUTSIDE_GROUP = 2.0  # the RolloutManager and its engine lock, one CPU each
EXTERNAL_ENGINE = 0.2


def placement_bundles(args: Any) -> int:
    """How many one-CPU bundles slime's placement group has (slime's own layout rule where it exists)."""
    try:
        from slime.ray.placement_group import _get_placement_group_layout
    except ImportError:  # another slime: its layout in words
        actor = args.actor_num_nodes * args.actor_num_gpus_per_node
        rollout = 0 if getattr(args, "rollout_external", False) or getattr(args, "colocate", False) else (
            args.rollout_num_gpus or 0)
        return actor + rollout
    return int(_get_placement_group_layout(args)[0])


def demand(args: Any) -> float:
    """Logical CPUs slime's driver, rollout manager and actors ask Ray for at once."""
    external = len(getattr(args, "rollout_external_engine_addrs", None) or [])
    return placement_bundles(args) + OUTSIDE_GROUP + EXTERNAL_ENGINE * external


def local_cpus(environ: dict[str, str] | None = None) -> float | None:
    """The logical CPUs of the cluster ``ray.init()`` would start here, or None when it would join an existing
    cluster (whose resources are its own)."""
    environ = os.environ if environ is None else environ
    from ray._private import services

    if environ.get("RAY_ADDRESS") or services.get_ray_address_from_environment(None, None):
        return None
    override = environ.get("RAY_OVERRIDE_RESOURCES")
    if override:
        try:
            resources = json.loads(override)
        except json.JSONDecodeError:
            raise SettingsError(f"RAY_OVERRIDE_RESOURCES={override!r} is not JSON. Fix: "
                                "export RAY_OVERRIDE_RESOURCES='{\"CPU\": 8}'") from None
        if isinstance(resources, dict) and "CPU" in resources:
            return float(resources["CPU"])
    from ray._private.utils import get_num_cpus

    return float(get_num_cpus())


def check(args: Any) -> None:
    """Raise a one-line :class:`SettingsError` when the local Ray cluster cannot place slime's actors. Only in
    the driver: a process where Ray is already running (slime's actors) has been placed."""
    if not hasattr(args, "actor_num_nodes"):  # not slime's parsed args (e.g. `slime-ascend config`'s own check)
        return
    import ray

    if ray.is_initialized():
        return
    have = local_cpus()
    need = demand(args)
    if have is None or have >= need:
        return
    want = max(8, math.ceil(need))
    raise SettingsError(
        f"Ray would start here with {have:g} logical CPUs, but slime asks for {need:g} "
        f"({placement_bundles(args)} placement-group bundles, the rollout manager and its lock"
        f"{', the external engines' if getattr(args, 'rollout_external_engine_addrs', None) else ''}), so "
        f"train.py would wait for ever. Fix: export RAY_OVERRIDE_RESOURCES='{{\"CPU\": {want}}}' (logical CPUs "
        f"are scheduling tokens, not cores) or start Ray yourself with `ray start --head --num-cpus {want}`")



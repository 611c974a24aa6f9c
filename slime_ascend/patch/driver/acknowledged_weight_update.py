"""slime's disk weight update switches every rollout engine, acknowledged, or none of them.

slime deletes each version directory at once (unless ``--update-weight-disk-keep-files``), so there is nothing
to return to; here the last acknowledged version's directory is the roll-back point (deleted, as slime would
have, once the next version is acknowledged; never with keep-files; only a directory this job wrote:
:class:`slime_ascend.weight_sync.version_dirs.VersionDirs`). The switch is
:func:`slime_ascend.weight_sync.acknowledged.switch_all_or_none`, on the same engines; the acknowledged version
is published through :mod:`slime_ascend.weight_sync.served_version`. With ``--update-weight-local-checkpoint-dir``
(each host pulls into one local directory, overwritten by each version) there is no roll-back point: slime's own
method runs and the versions are then read back.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, method_mismatch

logger = logging.getLogger("slime_ascend.patch")
ACTOR_GROUP = "slime.ray.actor_group"
ATTR = "_reload_rollout_weights_from_disk"
# what the replacement reproduces of slime's method (checked, so a change upstream is noticed)
EXPECTED_SOURCE = ("get_updatable_engines_and_lock", "pause_generation", "flush_cache", "update_weights_from_disk",
                   "continue_generation", "update_weight_local_checkpoint_dir", "update_weight_disk_keep_files",
                   "offload_rollout", "onload_weights")


def _reload(original):
    def _reload_rollout_weights_from_disk(self, disk_weight_dir, weight_version):
        import ray

        from ...plugins.settings import read
        from ...weight_sync import acknowledged, served_version
        from ...weight_sync.version_dirs import VersionDirs

        args = self.args
        deadline_s = read(acknowledged.WEIGHT_UPDATE_DEADLINE, args)
        if args.update_weight_local_checkpoint_dir:  # one local directory, overwritten: no roll-back point
            original(self, disk_weight_dir, weight_version)
            engines, *_ = ray.get(self._rollout_manager.get_updatable_engines_and_lock.remote())
            acknowledged.require_serving(engines, ray.get, weight_version, deadline_s)
            served_version.publish(weight_version)
            return None
        assert self._rollout_manager is not None, "disk weight update requires a rollout manager."
        if args.offload_rollout:
            ray.get(self._rollout_manager.onload_weights.remote())
        engines, *_ = ray.get(self._rollout_manager.get_updatable_engines_and_lock.remote())
        written = getattr(self, "_ascend_version_dirs", None)
        if written is None and not args.update_weight_disk_keep_files:
            written = self._ascend_version_dirs = VersionDirs.for_args(args)
        ours = written is not None and written.claim(disk_weight_dir, weight_version)
        if not engines:
            if ours:
                written.delete(disk_weight_dir, weight_version)
            return None
        previous = getattr(self, "_ascend_served", None)
        if previous is None:
            previous = acknowledged.initial_served(engines, ray.get, args.hf_checkpoint, deadline_s)
        served = acknowledged.switch_all_or_none(engines, ray.get, str(disk_weight_dir), str(weight_version), previous,
                                                 deadline_s)
        self._ascend_served = served
        # the new version is the roll-back point now; the one before goes, as slime would have deleted it (only
        # a directory this job wrote: the starting checkpoint was never claimed)
        if previous is not None and written is not None and previous.model_path != served.model_path:
            written.delete(previous.model_path, previous.version)
        if str(weight_version).isdigit():
            served_version.publish(weight_version)
        return None

    _reload_rollout_weights_from_disk.__wrapped__ = original
    return _reload_rollout_weights_from_disk


class AcknowledgedWeightUpdate(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        return method_mismatch(modules[ACTOR_GROUP], f"RayTrainGroup.{ATTR}",
                               ["self", "disk_weight_dir", "weight_version"], EXPECTED_SOURCE)

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        group = modules[ACTOR_GROUP].RayTrainGroup
        self.wrap(group, ATTR, _reload)


PATCH = AcknowledgedWeightUpdate(
    id="driver.acknowledged_weight_update",
    targets=(f"{ACTOR_GROUP}:RayTrainGroup.{ATTR}",),
    why="slime's disk weight update assumes every engine switched (it reads the versions back only under "
    "--ci-test); an engine that fails leaves the others on the new version, and the old version's files are "
    "already gone.",
    how="Pause, load on every engine, read every engine's served version back; on any failure return every "
    "engine to the last acknowledged version (its directory is kept until the next one is acknowledged) and "
    "fail in one line; resume; publish the acknowledged version for the staleness plugin. Each engine answer is "
    "waited for at most ascend_weight_update_deadline_s: a silent engine is left out, not waited for. Delete "
    "only version "
    "directories this job wrote (marker + resolved path), never the starting checkpoint or --load.",
    upstream="patches/0012-acknowledged-weight-update.patch",
    checked_on=("0.3.1",),
)

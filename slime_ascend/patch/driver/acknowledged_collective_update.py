"""After a weight push over a collective, every rollout engine's version is read back and published.

slime's ``RayTrainGroup.update_weights`` on the distributed (and colocated tensor) transport has the train actors
broadcast the buckets and returns; nothing checks what the engines serve, so ``staleness`` could only assume
"what was sent". The wrapper runs slime's method, then (actor role, not the disk transport, which
``driver.acknowledged_weight_update`` covers) reads every engine's served version back
(:func:`slime_ascend.weight_sync.pushed_version.acknowledge_push`: one numeric version, newer than the last) and
publishes it (:mod:`slime_ascend.weight_sync.served_version`).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, method_mismatch, missing_attrs

ACTOR_GROUP = "slime.ray.actor_group"
ATTR = "update_weights"
EXPECTED_SOURCE = ("_full_disk_weight_update_enabled", "actor.update_weights.remote()")


def _wrap(original):
    @functools.wraps(original)
    def update_weights(self):
        result = original(self)
        if self.role != "actor" or self._full_disk_weight_update_enabled() or self._rollout_manager is None:
            return result
        import ray

        from ...plugins.settings import read
        from ...weight_sync import served_version
        from ...weight_sync.acknowledged import WEIGHT_UPDATE_DEADLINE
        from ...weight_sync.pushed_version import acknowledge_push

        engines, *_ = ray.get(self._rollout_manager.get_updatable_engines_and_lock.remote())
        if not engines:
            return result
        version = acknowledge_push(engines, ray.get, getattr(self, "_ascend_pushed_version", None),
                                   read(WEIGHT_UPDATE_DEADLINE, self.args))
        self._ascend_pushed_version = version
        served_version.publish(version)
        return result

    return update_weights


class AcknowledgedCollectiveUpdate(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        group = modules[ACTOR_GROUP]
        problems = missing_attrs(group, ["RayTrainGroup._full_disk_weight_update_enabled"])
        return problems or method_mismatch(group, f"RayTrainGroup.{ATTR}", ["self"], EXPECTED_SOURCE, unwrap=True)

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        self.wrap(modules[ACTOR_GROUP].RayTrainGroup, ATTR, _wrap)


PATCH = AcknowledgedCollectiveUpdate(
    id="driver.acknowledged_collective_update",
    targets=(f"{ACTOR_GROUP}:RayTrainGroup.{ATTR}",),
    why="on the distributed and colocated transports slime never reads back what the rollout engines serve after "
        "a push, so a broadcast that broke off goes unnoticed and staleness judges by what was sent.",
    how="Run slime's update_weights, then read every engine's weight version back: one numeric version, newer than "
        "the last, or fail in one line naming each engine; publish it for the staleness plugin.",
    upstream="patches/0023-acknowledged-collective-update.patch",
    checked_on=("0.3.1",),
)

"""After ``--load``, slime's disk weight versions go on from the saved step instead of starting again at 1.

``RayTrainGroup`` counts disk weight versions from ``args.update_weight_start_version`` (0 unless a config sets
it) whatever checkpoint it resumes: a job stopped after rollout ``s - 1`` and restarted with ``--load`` pushes
"version 1" again (other weights than the first run's version 1), so the versions the engines report, the
staleness plugin's lags and slime's ``weight_vNNNNNN`` directories go backwards.

Here, before the actor group's train actors start (``create`` hands the counter to them as
``update_weight_start_version``; their disk writer names each version directory with it), the rollout the job
resumes at is read as slime will take it (``--start-rollout-id``, else the ``--load`` Megatron checkpoint's
step + 1, checked against what the actors report), and the counter is set to the number of pushes the uninterrupted job made of weights
older than the resumed ones: ``ceil(s / k)``, ``k`` = 1 for ``train.py`` (a push after every step) and
``--update-weights-interval`` for ``train_async.py``. The resumed job's first push is then the version the
uninterrupted job gave the same weights (``train.py``: ``s + 1``), and every later version is the one it
would have had. Nothing changes on a fresh start (resumed rollout 0), when a config sets
``update_weight_start_version``, or on a re-``create`` (``--release-train``: the counter is already running).

Upstream: patches/0018-resumed-weight-version.patch.
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, method_mismatch, missing_source

logger = logging.getLogger("slime_ascend.patch")
ACTOR_GROUP = "slime.ray.actor_group"
ATTR = "create"
EXPECTED_SOURCE = ("self.args.update_weight_start_version = self._disk_weight_version", "start_rollout_ids",
                   "return start_rollout_ids")


def pushes_before(start_rollout_id: int, script: str, update_weights_interval: int) -> int:
    """How many weight pushes the uninterrupted job made of weights older than those after rollout
    ``start_rollout_id - 1`` (its first push, of the loaded weights, not counted)."""
    every = max(1, int(update_weights_interval or 1)) if script == "train_async.py" else 1
    return math.ceil(start_rollout_id / every)


def resumed_rollout(args: Any) -> int:
    """The rollout slime resumes at: ``--start-rollout-id`` (slime sets 0 when ``--load`` is no Megatron
    checkpoint), else the loaded Megatron step + 1 (``--ckpt-step``, else the checkpoint's
    ``latest_checkpointed_iteration.txt``: what the train actors will load and report)."""
    if getattr(args, "start_rollout_id", None) is not None:
        return int(args.start_rollout_id)
    step = getattr(args, "ckpt_step", None)
    if step is None:
        tracker = Path(args.load) / "latest_checkpointed_iteration.txt"
        text = tracker.read_text().strip() if tracker.is_file() else ""
        if not text.isdigit():  # "release" or unreadable: no step to go on from
            return 0
        step = int(text)
    return int(step) + 1


def _create(original):
    def create(self, rollout_manager=None):
        resume = (self.role == "actor" and not self._actor_handlers and self._disk_weight_version == 0
                  and not getattr(self.args, "update_weight_start_version", 0))  # a config's start is theirs
        start = resumed_rollout(self.args) if resume else 0
        if start > 0:
            # before the actors start: slime's create hands this counter to them (update_weight_start_version),
            # and their disk writer names each version directory with it
            script = Path(sys.argv[0]).name
            version = pushes_before(start, script, getattr(self.args, "update_weights_interval", 1))
            self._disk_weight_version = version
            logger.info("resumed at rollout %d (%s): weight versions go on after %d (the next push is version %d)",
                        start, script, version, version + 1)
        start_rollout_ids = original(self, rollout_manager)
        if start > 0 and getattr(self.args, "start_rollout_id", None) is None and start_rollout_ids \
                and int(start_rollout_ids[0]) != start:
            raise RuntimeError(
                f"driver.resumed_weight_version expected the train actors to resume at rollout {start} (from "
                f"{self.args.load}), they report {start_rollout_ids[0]}. Fix: pass --start-rollout-id")
        return start_rollout_ids

    create.__wrapped__ = original
    return create


class ResumedWeightVersion(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        group = modules[ACTOR_GROUP]
        problems = method_mismatch(group, f"RayTrainGroup.{ATTR}", ["self", "rollout_manager"], EXPECTED_SOURCE)
        if problems:
            return problems
        return missing_source(group.RayTrainGroup.__init__, ['getattr(args, "update_weight_start_version", 0)'],
                              "RayTrainGroup.__init__")

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        self.wrap(modules[ACTOR_GROUP].RayTrainGroup, ATTR, _create)


PATCH = ResumedWeightVersion(
    id="driver.resumed_weight_version",
    targets=(f"{ACTOR_GROUP}:RayTrainGroup.{ATTR}",),
    why="slime counts disk weight versions from 0 on every start: a job restarted with --load pushes version 1 "
    "again, other weights under a version number the first run already used; versions (and staleness lags) go "
    "backwards.",
    how="Wrap RayTrainGroup.create: when the actor group resumes at rollout s > 0 (--start-rollout-id, else the "
    "--load checkpoint's step + 1) and no config set update_weight_start_version, set its version counter, before "
    "the actors start, to ceil(s / k) (k = 1 for train.py, "
    "--update-weights-interval for train_async.py), the pushes the uninterrupted job made before.",
    upstream="patches/0018-resumed-weight-version.patch",
    checked_on=("0.3.1",),
)

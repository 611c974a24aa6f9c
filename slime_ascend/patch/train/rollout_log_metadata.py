"""The train-side rollout logger skips the ``metadata`` that ``rollout.forward_metadata`` forwards.

Installed wherever ``rollout.forward_metadata`` is: the per-sample dicts would break the logger's sums.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, param_mismatch

TRAIN_METRICS = "slime.observability.train_metric_utils"
KEY = "metadata"


def _wrap_log(original):
    @functools.wraps(original)
    def log_rollout_data(rollout_id, args, rollout_data, *rest, **kwargs):
        if KEY not in rollout_data:
            return original(rollout_id, args, rollout_data, *rest, **kwargs)
        metadata = rollout_data.pop(KEY)
        try:
            return original(rollout_id, args, rollout_data, *rest, **kwargs)
        finally:
            rollout_data[KEY] = metadata

    return log_rollout_data


class RolloutLogMetadata(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        metrics = modules[TRAIN_METRICS]
        problems = missing_attrs(metrics, ["log_rollout_data"])
        if not problems:
            problems += param_mismatch(metrics.log_rollout_data, ["rollout_id", "args", "rollout_data"])
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        self.wrap(modules[TRAIN_METRICS], "log_rollout_data", _wrap_log)


PATCH = RolloutLogMetadata(
    id="train.rollout_log_metadata",
    targets=(f"{TRAIN_METRICS}:log_rollout_data",),
    why="rollout.forward_metadata puts per-sample dicts in rollout_data; slime's train-side rollout logger "
    "sums every list it does not know.",
    how="Call log_rollout_data without the metadata key and put it back afterwards.",
    upstream="patches/0004-forward-metadata-extra-batch-keys.patch",
    checked_on=("0.3.1",),
)

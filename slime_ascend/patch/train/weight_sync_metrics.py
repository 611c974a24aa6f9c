"""Weight-sync bytes, quantisation time and GB/s on slime's perf log.

slime's updaters expose ``pop_metrics()``, which the actor drains into ``log_perf_data`` after each train step;
only the delta updater fills it. ``update_weights`` runs in ``slime_ascend.weight_sync.metrics.sync_timer``,
and ``pop_metrics`` is wrapped only on the classes that define it.
Upstream: the quantizer hook proposal lets a hook return metrics with its tensors.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs
from ._updaters import UPDATERS, updater_classes


def _wrap_update(original):
    @functools.wraps(original)
    def update_weights(self, *a, **kw):
        from slime_ascend.weight_sync import metrics

        with metrics.sync_timer():
            return original(self, *a, **kw)

    return update_weights


def _wrap_pop(original):
    @functools.wraps(original)
    def pop_metrics(self, *a, **kw):
        from slime_ascend.weight_sync import metrics

        out = dict(original(self, *a, **kw) or {})
        out.update(metrics.drain())
        return out

    return pop_metrics


class WeightSyncMetrics(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        problems: list[str] = []
        for module_name, cls_name in UPDATERS.items():
            problems += missing_attrs(modules[module_name], [f"{cls_name}.update_weights", f"{cls_name}.pop_metrics"])
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        for cls in updater_classes(modules):
            if "update_weights" in vars(cls):
                self.wrap(cls, "update_weights", _wrap_update)
            if "pop_metrics" in vars(cls):
                self.wrap(cls, "pop_metrics", _wrap_pop)


PATCH = WeightSyncMetrics(
    id="train.weight_sync_metrics",
    targets=tuple(f"{m}:{c}.{a}" for m, c in UPDATERS.items() for a in ("update_weights", "pop_metrics")),
    why="slime's updaters report no bytes / quantisation time / throughput for a weight sync.",
    how="Time update_weights of every updater and merge our counters (perf/weight_sync_*) into pop_metrics().",
    upstream="patches/0005-quantizer-hook.patch",
    checked_on=("0.3.1",),
)

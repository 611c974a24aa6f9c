"""Forward each sample's ``train_metadata`` to the trainer as ``rollout_data["metadata"]``.

``RolloutManager._split_train_data_by_dp`` ships only a fixed list of keys to each data-parallel rank. While it
runs, the full ``data`` is remembered, and ``tensorize_rollout_data_for_training`` (called by it once per rank
with that rank's dict, which holds ``partition``) adds ``metadata = [data["metadata"][j] for j in partition]``.
The train-side counterpart, ``train.rollout_log_metadata``, keeps the list out of the train-side rollout logger.

Ray runs an actor from a by-value (cloudpickle) copy of its class: the live RolloutManager's
``_split_train_data_by_dp`` is not the module's, and it reads its globals (among them
``tensorize_rollout_data_for_training``) from a private dict, so wrapping the module reaches
nothing. When the patch is installed inside the RolloutManager actor, the live copy's method is
therefore replaced by one that calls the module's (wrapped) method, which runs the same slime
code with the module's globals.
"""

from __future__ import annotations

import functools
import threading
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source, param_mismatch

ROLLOUT = "slime.ray.rollout"
KEY = "metadata"

_current = threading.local()


def _wrap_split(original):
    @functools.wraps(original)
    def _split_train_data_by_dp(self, data):
        _current.data = data
        try:
            return original(self, data)
        finally:
            _current.data = None

    return _split_train_data_by_dp


def _wrap_tensorize(original):
    @functools.wraps(original)
    def tensorize_rollout_data_for_training(rollout_data):
        data = getattr(_current, "data", None)
        if data is not None and KEY in data and "partition" in rollout_data and KEY not in rollout_data:
            rollout_data[KEY] = [data[KEY][j] for j in rollout_data["partition"]]
        return original(rollout_data)

    return tensorize_rollout_data_for_training


def _delegate_to(module_cls):
    def _split_train_data_by_dp(self, data):
        return module_cls._split_train_data_by_dp(self, data)  # looked up per call: the module's wrapped method

    return _split_train_data_by_dp


def live_actor_class(module_cls: type) -> type | None:
    """The class of this process's Ray actor that defines ``_split_train_data_by_dp``, when that actor is a
    (by-value) copy of ``module_cls``; None outside such an actor or when it is ``module_cls`` itself."""
    try:
        import ray

        worker = ray._private.worker.global_worker
        instance = worker.actors.get(worker.actor_id)
    except Exception:  # noqa: BLE001 - no Ray, or not connected: not inside an actor
        return None
    if instance is None:
        return None
    for klass in type(instance).__mro__:
        if (klass.__name__ == module_cls.__name__ and klass.__module__ == module_cls.__module__
                and "_split_train_data_by_dp" in vars(klass)):
            return None if klass is module_cls else klass
    return None


class ForwardMetadata(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        problems: list[str] = []
        rollout = modules.get(ROLLOUT)
        if rollout is not None:
            problems += missing_attrs(rollout, ["tensorize_rollout_data_for_training"])
            manager = getattr(rollout, "RolloutManager", None)
            cls = getattr(manager, "__ray_actor_class__", manager)
            split = getattr(cls, "_split_train_data_by_dp", None)
            if split is None:
                problems.append("RolloutManager._split_train_data_by_dp is missing")
            else:
                problems += param_mismatch(split, ["self", "data"], "RolloutManager._split_train_data_by_dp")
                problems += missing_source(split, ['"partition": partition', "tensorize_rollout_data_for_training(rollout_data)"],
                                           "RolloutManager._split_train_data_by_dp")
            convert = getattr(cls, "_convert_samples_to_train_data", None)
            if convert is not None:
                problems += missing_source(convert, ['train_data["metadata"]'], "RolloutManager._convert_samples_to_train_data")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        rollout = modules.get(ROLLOUT)
        if rollout is not None:
            manager = rollout.RolloutManager
            module_cls = getattr(manager, "__ray_actor_class__", manager)
            self.wrap(module_cls, "_split_train_data_by_dp", _wrap_split)
            self.wrap(rollout, "tensorize_rollout_data_for_training", _wrap_tensorize)
            live = live_actor_class(module_cls)
            if live is not None:  # inside the RolloutManager actor: Ray's copy of the class is what runs
                self.replace(live, "_split_train_data_by_dp", _delegate_to(module_cls))


PATCH = ForwardMetadata(
    id="rollout.forward_metadata",
    targets=(f"{ROLLOUT}:RolloutManager._split_train_data_by_dp", f"{ROLLOUT}:tensorize_rollout_data_for_training"),
    why="slime drops train_data['metadata'] (Sample.train_metadata) before training; plugins need per-sample "
    "facts in the trainer (OPD teacher and coefficient).",
    how="Slice metadata by each DP rank's partition inside the per-rank tensorize call (in the RolloutManager "
    "actor, Ray's by-value copy of the class delegates to the module's method).",
    upstream="patches/0004-forward-metadata-extra-batch-keys.patch",
    checked_on=("0.3.1",),
)

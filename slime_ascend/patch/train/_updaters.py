"""slime's weight updater classes, shared by the patches that wrap their ``update_weights``
(``train.weight_sync_metrics``, ``train.reset_optimizer_on_push``)."""

from __future__ import annotations

import importlib
from types import ModuleType

_U = "slime.backends.megatron_utils.update_weight."
UPDATERS = {
    _U + "update_weight_from_distributed": "UpdateWeightFromDistributed",
    _U + "update_weight_from_tensor": "UpdateWeightFromTensor",
    _U + "update_weight_from_disk": "UpdateWeightFromDisk",
}
OPTIONAL = {_U + "update_weight_from_disk_delta": "UpdateWeightFromDiskDelta"}  # needs zstd etc.


def updater_classes(modules: dict[str, ModuleType]) -> list[type]:
    """The updater classes of the loaded target ``modules``, and the optional ones that import."""
    classes = [getattr(modules[m], c) for m, c in UPDATERS.items()]
    for module_name, cls_name in OPTIONAL.items():
        try:
            classes.append(getattr(importlib.import_module(module_name), cls_name))
        except (ImportError, AttributeError):
            pass
    return classes

"""Engine-side repack around a sync for Ascend W8A8_DYNAMIC (slime's gate covers compressed-tensors only).

An msModelSlim W8A8_DYNAMIC checkpoint has no ``quantization_config`` (slime's updaters get None), yet the
engine transposes and NZ-casts the int8 weight and flattens the scales after loading, so a sync must be
bracketed by restore / post-process exactly like compressed-tensors. (The disk transport reloads through the
engine's loader, which post-processes by itself.)

:func:`slime_ascend.weight_sync.funnel.needs_engine_post_process` decides; the gate
(:class:`~slime_ascend.weight_sync.engine_gate.PostProcessGate`) is restored afterwards, also on error. Our
funnel and ``train.quantize_params`` unwrap it, so no quantizer sees it.
Upstream: a configurable post-process list instead of the hard-coded ``["compressed-tensors"]``.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source
from ._updaters import UPDATERS

CLASSES = {m: c for m, c in UPDATERS.items() if c in ("UpdateWeightFromDistributed", "UpdateWeightFromTensor")}
GATE_SOURCE = 'self.quantization_config["quant_method"] in ["compressed-tensors"]'


def _wrap(original):
    @functools.wraps(original)
    def update_weights(self, *a, **kw):
        from slime_ascend.weight_sync.engine_gate import PostProcessGate
        from slime_ascend.weight_sync.funnel import needs_engine_post_process

        saved = self.quantization_config
        if not needs_engine_post_process(self.args, saved):
            return original(self, *a, **kw)
        self.quantization_config = PostProcessGate(saved)
        try:
            return original(self, *a, **kw)
        finally:
            self.quantization_config = saved

    return update_weights


class QuantPostProcess(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        problems: list[str] = []
        for module_name, cls_name in CLASSES.items():
            module = modules[module_name]
            missing = missing_attrs(module, [cls_name, f"{cls_name}.update_weights", "post_process_weights"])
            if missing:
                problems += missing
                continue
            problems += missing_source(getattr(module, cls_name).update_weights,
                                       [GATE_SOURCE, "restore_weights_before_load=True"],
                                       f"{cls_name}.update_weights")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        for module_name, cls_name in CLASSES.items():
            self.wrap(getattr(modules[module_name], cls_name), "update_weights", _wrap)


PATCH = QuantPostProcess(
    id="train.quant_post_process",
    targets=tuple(f"{m}:{c}.update_weights" for m, c in CLASSES.items()),
    why="slime triggers the engines' restore/post-process around a sync only for compressed-tensors; Ascend "
        "W8A8_DYNAMIC engines repack weights after loading too, but slime sees no quantization_config for them.",
    how="Wrap update_weights of the distributed and tensor updaters; for int8-w8a8 syncs the updater's "
        "quantization_config is a PostProcessGate (reads as compressed-tensors) for that one call.",
    upstream="patches/0005-quantizer-hook.patch",
    checked_on=("0.3.1",),
)

"""MindSpeed: adaptor before Megatron, ``repatch(args)`` after slime's init.

MindSpeed adapts Megatron to Ascend by patching it at import (``mindspeed.megatron_adaptor``
must be imported before anything imports ``megatron``) and re-patching once the real arguments
are known (``repatch``). The fork edits slime's ``train.py`` and ``actor.py`` for both. Here the ``npu``
plugin's process-start action registers the adaptor import to run right before the first ``import megatron``
(:func:`slime_ascend.accelerator.mindspeed.import_adaptor_before_megatron`); this patch runs with slime's
final args, before Megatron initialises.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs

ADAPTOR = "mindspeed.megatron_adaptor"


class MindSpeedRepatch(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        return missing_attrs(modules[ADAPTOR], ["repatch"])

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        if args is None:
            raise ValueError("train.mindspeed_repatch needs slime's args")
        modules[ADAPTOR].repatch(vars(args))


PATCH = MindSpeedRepatch(
    id="train.mindspeed_repatch",
    targets=(f"{ADAPTOR}:repatch",),
    why="MindSpeed must see slime's final args to enable its Ascend kernels and features.",
    how="Call mindspeed.megatron_adaptor.repatch(vars(args)) in each train actor as it starts.",
    upstream="patches/0001-plugin-import-from-environment.patch",
    checked_on=("0.3.1",),
)

"""Megatron's ``get_device_arch_version`` answers 8 on Ascend (MindSpeed's), without MindSpeed.

``megatron.training.arguments.validate_args`` calls ``get_device_arch_version()``
(``torch.cuda.get_device_properties("cuda:0").major``) whenever tensor or context parallelism is above 1. Under
``transfer_to_npu`` that is torch_npu's device properties, whose ``major`` is None: ``None < 10`` raises
``TypeError`` in the driver's ``parse_args``. MindSpeed's adaptor replaces the function with one that returns 8
(Ascend/MindSpeed 0.12.1, commit 028de58c: ``mindspeed/features_manager/megatron_basic/megatron_basic.py:156-158``
registers ``mindspeed/core/megatron_basic/megatron_basic.py:131`` ``get_device_arch_version`` on
``megatron.training.utils.get_device_arch_version``). This patch is that function for an Ascend host without
MindSpeed (:func:`slime_ascend.accelerator.plugin.without_mindspeed`), on every binding Megatron reads it from.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source

DEFINED = "megatron.training.utils.common_utils"
# where Megatron reads it: the definition, the package's re-export, and arguments.py's by-name import
BINDINGS = (DEFINED, "megatron.training.utils", "megatron.training.arguments")
ARCH_VERSION = 8  # MindSpeed's answer: below 10, Megatron keeps its pre-Blackwell rules (warnings only)


def get_device_arch_version() -> int:
    """MindSpeed's ``get_device_arch_version``: 8."""
    return ARCH_VERSION


class NpuDeviceArchVersion(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        problems: list[str] = []
        for name in BINDINGS:
            problems += missing_attrs(modules[name], ["get_device_arch_version"])
        if not problems:
            original = modules[DEFINED].get_device_arch_version
            problems += missing_source(original, ["get_device_properties", ".major"], f"{DEFINED}.get_device_arch_version")
            stray = [n for n in BINDINGS if modules[n].get_device_arch_version is not original]
            if stray:
                problems.append(f"{', '.join(stray)} no longer bind the function {DEFINED} defines")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        for name in BINDINGS:
            self.replace(modules[name], "get_device_arch_version", get_device_arch_version)


PATCH = NpuDeviceArchVersion(
    id="train.npu_device_arch_version",
    targets=tuple(f"{name}:get_device_arch_version" for name in BINDINGS),
    why="Megatron's validate_args reads get_device_arch_version() = torch.cuda.get_device_properties('cuda:0').major "
    "for tensor or context parallelism above 1; under transfer_to_npu that is torch_npu's properties, whose major is "
    "None, and the comparison raises TypeError in the driver's parse_args. MindSpeed replaces the function "
    "(mindspeed/features_manager/megatron_basic/megatron_basic.py:156-158, its get_device_arch_version at "
    "mindspeed/core/megatron_basic/megatron_basic.py:131, MindSpeed 0.12.1 commit 028de58c).",
    how="get_device_arch_version -> MindSpeed's (returns 8) in megatron.training.utils.common_utils, its re-export in "
    "megatron.training.utils and arguments.py's by-name import, when megatron.training.arguments is imported. Only "
    "on an Ascend host without MindSpeed.",
    upstream="patches/megatron/megatron-device-arch-version.md",
    checked_on=("0.3.1",),
)

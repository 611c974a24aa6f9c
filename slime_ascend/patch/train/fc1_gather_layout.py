"""TP all-gather of ``linear_fc1`` on MindSpeed parameters: concatenate along dim 0.

MindSpeed's column-parallel linear layers on Ascend carry a ``partition_dim`` that does not match the GLU fc1
layout slime's weight sync expects (the fork's slime.patch forces ``partition_dim = 0`` for ``linear_fc1`` in
``update_weight/common.py``). The parameter attribute is corrected in place, once, and the original function runs.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source, param_mismatch

COMMON = "slime.backends.megatron_utils.update_weight.common"
BY_NAME = {
    "slime.backends.megatron_utils.update_weight.update_weight_from_distributed": ("all_gather_param",),
    "slime.backends.megatron_utils.update_weight.hf_weight_iterator_direct": ("all_gather_params_async",),
}


def fix_partition_dim(name: str, param: Any) -> None:
    if "linear_fc1" in name and getattr(param, "tensor_model_parallel", False):
        if getattr(param, "partition_dim", 0) != 0:
            param.partition_dim = 0


def _wrap_single(original):
    @functools.wraps(original)
    def all_gather_param(name, param):
        fix_partition_dim(name, param)
        return original(name, param)

    return all_gather_param


def _wrap_batch(original):
    @functools.wraps(original)
    def all_gather_params_async(param_infos_and_params):
        for info, param in param_infos_and_params:
            fix_partition_dim(info.name, param)
        return original(param_infos_and_params)

    return all_gather_params_async


WRAPPERS = {"all_gather_param": _wrap_single, "all_gather_params_async": _wrap_batch}


class FC1GatherLayout(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        problems: list[str] = []
        common = modules.get(COMMON)
        if common is not None:
            problems += missing_attrs(common, WRAPPERS)
            if not problems:
                problems += param_mismatch(common.all_gather_param, ["name", "param"])
                problems += param_mismatch(common.all_gather_params_async, ["param_infos_and_params"])
                problems += missing_source(common.all_gather_param, ["partition_dim = param.partition_dim"])
        for name, attrs in BY_NAME.items():
            if name in modules:
                problems += missing_attrs(modules[name], attrs)
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        for name, module in modules.items():
            attrs = WRAPPERS if name == COMMON else BY_NAME.get(name, ())
            for attr in attrs:
                self.wrap(module, attr, WRAPPERS[attr])


PATCH = FC1GatherLayout(
    id="train.fc1_gather_layout",
    targets=tuple(f"{COMMON}:{a}" for a in WRAPPERS) + tuple(f"{m}:{a}" for m, attrs in BY_NAME.items() for a in attrs),
    why="MindSpeed fc1 parameters report a partition_dim that makes slime gather the GLU fc1 weight on the wrong axis.",
    how="Wrap the TP all-gather helpers (and their by-name imports) to set partition_dim=0 on linear_fc1 first.",
    upstream="patches/0007-fc1-gather-partition-dim.patch",
    checked_on=("0.3.1",),
)

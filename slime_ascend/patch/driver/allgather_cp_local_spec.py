"""slime accepts ``--allgather-cp`` for a dense model when the ``cpu`` plugin's layer spec runs its attention.

slime's ``megatron_parse_args`` calls ``_validate_allgather_cp_supported(args, hf_config)``
(``slime/backends/megatron_utils/arguments.py``), which refuses ``--allgather-cp`` with
``--context-parallel-size`` above 1 unless the HF architecture is a DSA one (DeepSeek-V3.2, GLM-5): other models
attend with TransformerEngine's zig-zag CP attention, which would scramble the contiguous allgather layout.
``slime_ascend.cpu.spec`` attends in that layout itself (``AllGatherCPAttention``: keys and values all-gathered,
causal and RoPE by global position), so with ``--spec slime_ascend.cpu.spec get_layer_spec`` the check is skipped;
with any other spec slime's check runs unchanged.

Upstream: patches/0015-allgather-cp-layer-spec-opt-in.patch (a layer spec declares that it handles the allgather
layout, and the check asks it).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source, param_mismatch

ARGUMENTS = "slime.backends.megatron_utils.arguments"
ATTR = "_validate_allgather_cp_supported"
CPU_SPEC = ["slime_ascend.cpu.spec", "get_layer_spec"]


def handles_allgather_cp(args: Any) -> bool:
    """The job's layer spec is the ``cpu`` plugin's, whose attention implements the allgather CP layout."""
    return list(getattr(args, "spec", None) or []) == CPU_SPEC


def _wrap(original):
    @functools.wraps(original)
    def _validate_allgather_cp_supported(args, hf_config=None):
        if handles_allgather_cp(args):
            return None
        return original(args, hf_config)

    return _validate_allgather_cp_supported


class AllGatherCPLocalSpec(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        mod = modules[ARGUMENTS]
        problems = missing_attrs(mod, [ATTR, "megatron_parse_args"])
        if problems:
            return problems
        problems += param_mismatch(getattr(mod, ATTR), ["args", "hf_config"], ATTR)
        problems += missing_source(mod.megatron_parse_args, [f"{ATTR}(args, hf_config)"], "megatron_parse_args")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        self.wrap(modules[ARGUMENTS], ATTR, _wrap)


PATCH = AllGatherCPLocalSpec(
    id="driver.allgather_cp_local_spec",
    targets=(f"{ARGUMENTS}:{ATTR}",),
    why="slime refuses --allgather-cp for every model but DSA ones (TransformerEngine's CP attention is zig-zag); "
    "the cpu plugin's layer spec attends in the allgather layout itself, so a dense model's CP run stops in "
    "parse_args with a traceback for no reason.",
    how="Wrap arguments._validate_allgather_cp_supported: with --spec slime_ascend.cpu.spec get_layer_spec it "
    "returns; otherwise slime's check runs unchanged.",
    upstream="patches/0015-allgather-cp-layer-spec-opt-in.patch",
    checked_on=("0.3.1",),
)

"""slime's weight-sync quantizer funnel runs our dispatcher first.

``convert_to_hf`` passes every converted parameter to ``quantize_params`` on every transport (distributed,
colocated tensors, disk, delta), so the fp8-sync / int8-sync / int4-sync plugins send the rollout engine's
checkpoint format, bit-identical to the offline converter, on any device. slime's original gets the real config
(a ``PostProcessGate`` from ``train.quant_post_process`` is unwrapped first).
Upstream: a ``--custom-quantize-params-path`` hook in ``processors/__init__.py``.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source, param_mismatch

MEGATRON_TO_HF = "slime.backends.megatron_utils.megatron_to_hf"
SIGNATURE = ["args", "megatron_name", "converted_named_params", "quantization_config", "transform_ue8m0"]


def _wrap(original):
    @functools.wraps(original)
    def quantize_params(args, megatron_name, converted_named_params, quantization_config, transform_ue8m0=True):
        from slime_ascend import hooks
        from slime_ascend.weight_sync.engine_gate import source_config

        out = hooks.quantize_params(args, megatron_name, converted_named_params, quantization_config, transform_ue8m0)
        if out is not None:
            return out
        return original(args, megatron_name, converted_named_params, source_config(quantization_config),
                        transform_ue8m0)

    quantize_params.__slime_ascend_original__ = original
    return quantize_params


class QuantizeParams(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        module = modules[MEGATRON_TO_HF]
        problems = missing_attrs(module, ["quantize_params", "convert_to_hf"])
        if problems:
            return problems
        problems += param_mismatch(module.quantize_params, SIGNATURE, "megatron_to_hf.quantize_params")
        problems += missing_source(module.convert_to_hf, ["return quantize_params(args, name, "],
                                   "megatron_to_hf.convert_to_hf")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        self.wrap(modules[MEGATRON_TO_HF], "quantize_params", _wrap)


PATCH = QuantizeParams(
    id="train.quantize_params",
    targets=(f"{MEGATRON_TO_HF}:quantize_params",),
    why="slime quantizes synced weights only for FP8 / compressed-tensors INT4, with CUDA-only kernels; other "
        "methods (INT8, Ascend W8A8) are sent in BF16.",
    how="Wrap megatron_to_hf.quantize_params (looked up by convert_to_hf at call time) so our dispatcher runs "
        "first; None falls through to slime's quantizer.",
    upstream="patches/0005-quantizer-hook.patch",
    checked_on=("0.3.1",),
)

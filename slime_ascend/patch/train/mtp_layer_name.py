"""slime's MTP weight names at Megatron-core 0.19 (``--mtp-num-layers``, ``--enable-mtp-training``).

Megatron-core 0.19 renamed the decoder layer inside each multi-token-prediction layer from ``transformer_layer``
to ``mtp_model_layer`` (``MultiTokenPredictionLayer.mtp_model_layer``; its sharded state dict maps old
checkpoints' ``transformer_layer.`` keys onto the new name). slime at the pinned tree still spells the old name
in each place that translates an MTP layer's parameters:

* HF -> Megatron (``hf_to_megatron/deepseek.py`` and the other converters): ``rest.removeprefix("transformer_layer.")``,
  so ``--load`` of an HF checkpoint with an MTP layer (GLM-5's ``model.layers.<N>.*``) stops in the train actor's
  init with ``KeyError: Unsupported DeepSeek Megatron layer parameter 'mtp_model_layer.input_layernorm.weight'``
  (found by running ``train.py`` with ``--mtp-num-layers 1`` on the tiny GLM-5 with an MTP layer);
* Megatron -> HF, every weight push (``megatron_to_hf/deepseekv3.py`` and the other converters):
  ``name.replace("transformer_layer.", "")`` leaves ``mtp_model_layer.`` in the HF name;
* the push's global names (``update_weight/common._named_params_and_buffers_global``): the MTP expert pattern
  ``transformer_layer\\.mlp\\.experts\\...`` does not match, so at EP > 1 an MTP expert keeps its local index.

This patch gives slime's code the name it was written for, at the one place all three read names from: slime's
global name walk (``_named_params_and_buffers_global``, behind ``named_params_and_buffers``, which both the HF
loader and every weight push iterate) sees the model chunks' parameters and buffers with
``mtp.layers.<i>.mtp_model_layer.<rest>`` spelled ``mtp.layers.<i>.transformer_layer.<rest>`` (the tensors are the
same; only the spelling of the key differs), so every later step (expert offsets, the converters, the quantisers)
runs as slime wrote it. Names without ``mtp_model_layer`` are untouched. Device-neutral: Ascend's Megatron (MindSpeed
on Megatron-core) gets it wherever its MTP layer has the new name.

Applied only where Megatron's MTP layer has the new name (``MultiTokenPredictionLayerSubmodules`` has
``mtp_model_layer``) and the job has MTP layers (``--mtp-num-layers``).

Upstream: patches/0027-mtp-layer-name-megatron-0.19.patch (each converter accepts both spellings).
"""

from __future__ import annotations

import functools
import re
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source, param_mismatch

COMMON = "slime.backends.megatron_utils.update_weight.common"
MTP = "megatron.core.transformer.multi_token_prediction"
NEW, OLD = "mtp_model_layer.", "transformer_layer."
_MTP_NAME = re.compile(r"((?:^|\.)mtp\.layers\.\d+\.)mtp_model_layer\.")


def slime_spelling(name: str) -> str:
    """``name`` with an MTP layer's ``mtp_model_layer.`` spelled ``transformer_layer.`` (slime's spelling); any
    other name unchanged."""
    return _MTP_NAME.sub(lambda m: m.group(1) + OLD, name)


def megatron_has_new_name(modules: dict[str, ModuleType] | None = None) -> bool:
    mtp = (modules or {}).get(MTP)
    if mtp is None:
        import importlib

        try:
            mtp = importlib.import_module(MTP)
        except ImportError:
            return False
    fields = getattr(getattr(mtp, "MultiTokenPredictionLayerSubmodules", None), "__dataclass_fields__", {})
    return "mtp_model_layer" in fields


def wanted(args: Any) -> bool:
    """The job has MTP layers and Megatron names their decoder layer ``mtp_model_layer``."""
    return bool(getattr(args, "mtp_num_layers", None)) and megatron_has_new_name()


class SlimeSpelledModule:
    """A model chunk whose ``named_parameters`` / ``named_buffers`` give MTP names in slime's spelling; anything
    else is the chunk's own."""

    def __init__(self, module: Any):
        self._module = module

    def named_parameters(self, *args: Any, **kwargs: Any):
        for name, param in self._module.named_parameters(*args, **kwargs):
            yield slime_spelling(name), param

    def named_buffers(self, *args: Any, **kwargs: Any):
        for name, buf in self._module.named_buffers(*args, **kwargs):
            yield slime_spelling(name), buf

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._module, attr)


def _wrap_names(original):
    @functools.wraps(original)
    def _named_params_and_buffers_global(args, model):
        return original(args, [SlimeSpelledModule(m) for m in model])

    return _named_params_and_buffers_global


class MTPLayerName(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        problems: list[str] = []
        common = modules.get(COMMON)
        if common is not None:
            found = missing_attrs(common, ["_named_params_and_buffers_global"])
            problems += found
            if not found:
                fn = common._named_params_and_buffers_global
                problems += param_mismatch(fn, ["args", "model"], "_named_params_and_buffers_global")
                problems += missing_source(fn, ["model_module.named_parameters()", r"transformer_layer\.mlp\.experts"],
                                           "_named_params_and_buffers_global")
                import inspect

                try:
                    if NEW.rstrip(".") in inspect.getsource(common):
                        problems.append("update_weight/common.py already spells mtp_model_layer (upstream fix "
                                        "merged): drop this patch")
                except (OSError, TypeError):
                    pass
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        self.wrap(modules[COMMON], "_named_params_and_buffers_global", _wrap_names)


PATCH = MTPLayerName(
    id="train.mtp_layer_name",
    targets=(f"{COMMON}:_named_params_and_buffers_global",),
    why="Megatron-core 0.19 names an MTP layer's decoder layer mtp_model_layer; slime's converters and its push's "
        "name walk spell it transformer_layer, so an HF --load with MTP layers stops with a KeyError and pushes "
        "carry unconverted names.",
    how="Wrap update_weight.common._named_params_and_buffers_global (behind named_params_and_buffers, which the HF "
        "loader and every push iterate): the model chunks' MTP names given in slime's spelling.",
    upstream="patches/0027-mtp-layer-name-megatron-0.19.patch",
    checked_on=("0.3.1",),
)

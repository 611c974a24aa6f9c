"""A PPO critic can start from a HuggingFace checkpoint (``--load <hf dir>``).

slime's critic replaces the LM head with a value head, ``LinearForLastLayer(hidden, 1)``, which has a bias
(``model_provider.py``). With ``--load`` an HF directory, ``hf_to_megatron.load_hf_weights`` ->
``common.load_model_hf_weights`` skips the value head's ``output_layer.weight`` (shape ``[1, hidden]`` vs the LM
head) but asks the model's HF converter for ``output_layer.bias`` too (``qwen_hf_tensor`` raises ``KeyError:
Unsupported Megatron parameter 'output_layer.bias'``), so the critic actor dies at start. Found by
``tests/e2e/test_slime_sao.py`` (slime's ``train.py`` with ``--advantage-estimator ppo`` and ``--load`` an HF
checkpoint).

The wrapped name is the one ``hf_to_megatron/__init__.py`` calls. Only a value head's bias that the converter
does not know (``KeyError``) is answered, with the parameter's own initial value; every other name, and every
other error, is unchanged.

Upstream: patches/0011-critic-hf-value-head-bias.patch (skip ``output_layer.bias`` of a value head in
``load_model_hf_weights``, next to the existing skip of its weight).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source, param_mismatch

HF = "slime.backends.megatron_utils.hf_to_megatron"
COMMON = "slime.backends.megatron_utils.hf_to_megatron.common"
BIAS = "output_layer.bias"


def value_head_biases(named: Any, strip: Any) -> dict[str, Any]:
    """{name: parameter} of value-head biases (``output_layer.bias`` with one output) among ``named``."""
    return {name: p for name, p in named if strip(name) == BIAS and p.dim() == 1 and p.shape[0] == 1}


def keep_value_head_bias(get_hf_tensor: Any, heads: dict[str, Any]) -> Any:
    """``get_hf_tensor`` that answers a value-head bias it does not know with the parameter's own value."""

    @functools.wraps(get_hf_tensor)
    def get(name, reader, config):
        try:
            return get_hf_tensor(name, reader, config)
        except KeyError:
            if name in heads:
                return heads[name].detach().clone()
            raise

    return get


def _wrap_load(original):
    @functools.wraps(original)
    def load_model_hf_weights(args, model, path, config, get_hf_tensor):
        from slime.backends.megatron_utils.hf_to_megatron.common import strip_mcore_wrappers
        from slime.backends.megatron_utils.update_weight.common import named_params_and_buffers

        heads = value_head_biases(named_params_and_buffers(args, model), strip_mcore_wrappers)
        if heads:
            get_hf_tensor = keep_value_head_bias(get_hf_tensor, heads)
        return original(args, model, path, config, get_hf_tensor)

    return load_model_hf_weights


class CriticHFValueHead(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        hf, common = modules.get(HF), modules.get(COMMON)
        problems: list[str] = []
        if hf is not None:
            problems += missing_attrs(hf, ["load_model_hf_weights", "load_hf_weights"])
            if not problems:
                problems += missing_source(hf.load_hf_weights, ["load_model_hf_weights("], "load_hf_weights")
        if common is not None:
            found = missing_attrs(common, ["load_model_hf_weights", "strip_mcore_wrappers"])
            problems += found
            if not found:
                fn = common.load_model_hf_weights
                problems += param_mismatch(fn, ["args", "model", "path", "config", "get_hf_tensor"],
                                           "load_model_hf_weights")
                problems += missing_source(fn, ['name.endswith("output_layer.weight")', "get_hf_tensor(name"],
                                           "load_model_hf_weights")
                import inspect

                try:
                    if BIAS in inspect.getsource(fn):
                        problems.append(f"load_model_hf_weights already handles {BIAS} (upstream fix merged): "
                                        "drop this patch")
                except (OSError, TypeError):
                    pass
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        self.wrap(modules[HF], "load_model_hf_weights", _wrap_load)


PATCH = CriticHFValueHead(
    id="train.critic_hf_value_head",
    targets=(f"{HF}:load_model_hf_weights", f"{COMMON}:load_model_hf_weights"),
    why="With --load an HF checkpoint, slime's HF loader asks the model converter for the critic value head's "
        "output_layer.bias, which no converter knows: the PPO critic cannot start from an HF checkpoint.",
    how="Wrap hf_to_megatron.load_model_hf_weights so that its converter answers a value head's output_layer.bias "
        "it does not know with the parameter's initial value (as slime already skips the head's weight).",
    upstream="patches/0011-critic-hf-value-head-bias.patch",
    checked_on=("0.3.1",),
)

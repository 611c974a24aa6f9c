"""slime's GLM-5 attention selects the checkpoint's ``index_topk`` keys, not always 2048.

``DSAMultiLatentAttention.__init__`` (``slime_plugins/models/glm5/glm5.py``) sets ``self.index_topk = 2048``
whatever the model's config says, while the rollout side (transformers' ``GlmMoeDsa``, SGLang's NSA indexer)
reads ``index_topk`` from ``config.json``. For GLM-5 both are 2048; for any other value (a small model, or one
whose sequences are longer than its ``index_topk``) train and rollout select different key sets.

The patch wraps ``get_glm5_spec`` to copy the HF config's ``index_topk`` onto the Megatron config (as it
already copies ``index_n_heads`` / ``index_head_dim``), and ``DSAMultiLatentAttention.__init__`` to use it when
present. Only where CUDA is absent (declared with the other glm5 patches).

Upstream: patches/0021-glm5-spec-device-backends.patch (``config.index_topk`` from the HF config).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source

GLM5 = "slime_plugins.models.glm5.glm5"


def _spec_with_topk(original):
    @functools.wraps(original)
    def get_glm5_spec(args, config, vp_stage):
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
        topk = getattr(hf_config, "index_topk", None)
        if topk is not None:
            config.index_topk = int(topk)
        return original(args, config, vp_stage)

    return get_glm5_spec


def _init_with_topk(original):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        original(self, config, *args, **kwargs)
        topk = getattr(config, "index_topk", None)
        if topk is not None:
            self.index_topk = int(topk)

    return __init__


class GLM5IndexTopk(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        mod = modules[GLM5]
        problems = missing_attrs(mod, ["get_glm5_spec", "DSAMultiLatentAttention.__init__"])
        if problems:
            return problems
        problems += missing_source(mod.DSAMultiLatentAttention.__init__, ["self.index_topk = 2048"],
                                   "DSAMultiLatentAttention.__init__")
        problems += missing_source(mod.get_glm5_spec, ["AutoConfig.from_pretrained(args.hf_checkpoint"],
                                   "get_glm5_spec")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        mod = modules[GLM5]
        self.wrap(mod, "get_glm5_spec", _spec_with_topk)
        self.wrap(mod.DSAMultiLatentAttention, "__init__", _init_with_topk)


PATCH = GLM5IndexTopk(
    id="train.glm5_index_topk",
    targets=(f"{GLM5}:get_glm5_spec", f"{GLM5}:DSAMultiLatentAttention.__init__"),
    why="slime's GLM-5 attention hard-codes index_topk = 2048; the rollout side reads the checkpoint's value.",
    how="Wrap get_glm5_spec to copy the HF config's index_topk onto the Megatron config, and "
        "DSAMultiLatentAttention.__init__ to take it from there.",
    upstream="patches/0021-glm5-spec-device-backends.patch",
    checked_on=("0.3.1",),
)

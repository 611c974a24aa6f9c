"""slime's GLM-5 spec builds its linears, norms and decoder block without TransformerEngine.

``slime_plugins/models/glm5/glm5.py`` takes them from TE: ``get_glm5_spec`` calls
``get_gpt_decoder_block_spec(config, use_transformer_engine=True)`` and ``TESpecProvider()`` for the attention's
linears and the indexer's ``k_norm``; ``DSAMLASelfAttention.__init__`` builds its down projections as ``TELinear``
(``parallel_mode="duplicated"``, chosen by ``submodules.linear_q_down_proj in [TELinear]``). Without TE (Ascend,
CPU) ``TELinear`` is a placeholder and the spec cannot be built.

The patch replaces the three names in ``glm5.py``'s namespace with the host parts of
:mod:`slime_ascend.cpu.glm5_spec` (TE's parameter names, so slime's converters and checkpoints are unchanged):
``TELinear`` -> ``HostDuplicatedLinear``, ``TESpecProvider`` -> ``HostSpecProvider``,
``get_gpt_decoder_block_spec`` -> ``decoder_block_spec`` (the local block with the cpu spec's norms and experts).
Only where CUDA is absent.

Upstream: patches/0021-glm5-spec-device-backends.patch.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source

GLM5 = "slime_plugins.models.glm5.glm5"
NAMES = ("TELinear", "TESpecProvider", "get_gpt_decoder_block_spec")
SPEC_SNIPPETS = ('"use_transformer_engine": True', "get_gpt_decoder_block_spec(config, **kwargs)",
                 "backend = TESpecProvider()", "backend.linear()", "backend.column_parallel_layer_norm_linear()",
                 "backend.row_parallel_linear()", "backend.layer_norm()", "backend.core_attention()")
INIT_SNIPPETS = ("submodules.linear_q_down_proj in [TELinear]", 'parallel_mode="duplicated"')


class GLM5HostSpec(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        mod = modules[GLM5]
        problems = missing_attrs(mod, (*NAMES, "get_glm5_spec", "DSAMLASelfAttention"))
        if problems:
            return problems
        problems += missing_source(mod.get_glm5_spec, SPEC_SNIPPETS, "get_glm5_spec")
        problems += missing_source(mod.DSAMLASelfAttention.__init__, INIT_SNIPPETS, "DSAMLASelfAttention.__init__")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        from slime_ascend.cpu.glm5_spec import HostDuplicatedLinear, HostSpecProvider, decoder_block_spec

        mod = modules[GLM5]
        for name, value in zip(NAMES, (HostDuplicatedLinear, HostSpecProvider, decoder_block_spec)):
            self.replace(mod, name, value)


PATCH = GLM5HostSpec(
    id="train.glm5_host_spec",
    targets=tuple(f"{GLM5}:{n}" for n in NAMES),
    why="slime's GLM-5 spec takes its linears, norms and decoder block from TransformerEngine (CUDA only).",
    how="Replace glm5.py's TELinear, TESpecProvider and get_gpt_decoder_block_spec with host parts under TE's "
        "parameter names (slime_ascend.cpu.glm5_spec); only where CUDA is absent.",
    upstream="patches/0021-glm5-spec-device-backends.patch",
    checked_on=("0.3.1",),
)

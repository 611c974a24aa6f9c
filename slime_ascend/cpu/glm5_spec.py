"""The parts of slime's GLM-5 spec that are TransformerEngine's, on the host (or any device): the adapter that
patch ``train.glm5_host_spec`` gives ``slime_plugins/models/glm5/glm5.py``.

slime's ``get_glm5_spec`` takes its linears and norms from ``TESpecProvider()`` and its decoder block from
``get_gpt_decoder_block_spec(config, use_transformer_engine=True)``; ``DSAMLASelfAttention`` builds its down
projections and indexer linears as ``TELinear(parallel_mode="duplicated")``. Here, with the parameter names slime's
converters read (TE's):

* :class:`HostDuplicatedLinear` -- ``TELinear`` with ``parallel_mode="duplicated"``: the full weight on every
  tensor-parallel rank, ``forward`` returns ``(x @ W.T, None)``; its parameters carry TE's attributes
  (``sequence_parallel`` under ``--sequence-parallel``: Megatron's ``finalize_model_grads`` sums their gradients
  over TP, each rank having seen its sequence shard; without it TP 2 trained ``q_a_proj`` and
  ``kv_a_proj_with_mqa`` on half the tokens, ``tests/glm5/test_glm5_tensor_parallel.py``);
* :class:`HostSpecProvider` -- ``TESpecProvider``'s five parts the spec uses: that linear, the norm-fused
  column linear (:class:`slime_ascend.cpu.spec.NormColumnParallelLinear`, ``layer_norm_weight``), Megatron's
  ``RowParallelLinear``, :class:`~slime_ascend.cpu.spec.HostNorm` and a core attention the spec never calls;
* :func:`decoder_block_spec` -- Megatron's local block spec (dense and MoE layers as ``--moe-layer-freq`` puts
  them) with the host parts of :mod:`slime_ascend.cpu.spec`: the input norm its own ``input_layernorm`` (the
  MLA down projections take the normed input, as in TE's MLA spec), dense MLPs with the norm inside
  ``linear_fc1``, MoE layers with ``pre_mlp_layernorm`` and TE's grouped-expert names, a host final norm.

An adapter: it imports Megatron and :mod:`.spec`, not slime.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule

from .spec import HostNorm, NormColumnParallelLinear, PackedSDPAttention, _moe_experts

__all__ = ["HostDuplicatedLinear", "HostSpecProvider", "decoder_block_spec"]


class HostDuplicatedLinear(MegatronModule):
    """``TELinear(parallel_mode="duplicated")``: one unsharded ``weight`` (and ``bias``), ``(out, bias)``."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool,
                 skip_bias_add: bool, parallel_mode: str | None = "duplicated",
                 skip_weight_param_allocation: bool = False, **_: Any):
        super().__init__(config=config)
        if parallel_mode != "duplicated":
            raise ValueError(f"HostDuplicatedLinear: parallel_mode {parallel_mode!r} is not supported (slime's GLM-5 "
                             "spec builds its TELinear as 'duplicated')")
        if skip_weight_param_allocation:
            raise ValueError("HostDuplicatedLinear: skip_weight_param_allocation=True is not supported")
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        with torch.no_grad():
            init_method(self.weight)
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype)) if bias else None
        self.skip_bias_add = skip_bias_add
        for param in self.parameters():
            # what Megatron's TELinear marks a duplicated weight: reduced over DP, not a TP shard, and under
            # --sequence-parallel summed over TP by finalize_model_grads (each rank fed its sequence shard)
            param.allreduce = True
            param.tensor_model_parallel = False
            param.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor):
        if self.skip_bias_add:
            return F.linear(x, self.weight), self.bias
        return F.linear(x, self.weight, self.bias), None

    def backward_dw(self) -> None:  # TE's delayed weight-gradient hook: nothing is delayed here
        return None


class HostSpecProvider:
    """``TESpecProvider``'s parts that slime's ``get_glm5_spec`` uses, on the host."""

    def linear(self) -> type:
        return HostDuplicatedLinear

    def column_parallel_layer_norm_linear(self) -> type:
        return NormColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return RowParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return HostNorm

    def core_attention(self) -> type:
        return PackedSDPAttention  # built by Megatron's Attention, never called: the spec runs SparseMLA itself


def decoder_block_spec(config, use_transformer_engine: bool = True, normalization: str | None = None,
                       qk_l2_norm: bool | None = False, vp_stage: int | None = None, pp_rank: int | None = None):
    """``get_gpt_decoder_block_spec``'s signature; the local block spec with the host parts (module docstring),
    whatever ``use_transformer_engine`` says."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=normalization,
                                       qk_l2_norm=qk_l2_norm, vp_stage=vp_stage, pp_rank=pp_rank)
    block.layer_specs = [_host_layer(spec) for spec in block.layer_specs]
    block.layer_norm = HostNorm
    return block


def _host_layer(spec):
    spec = copy.deepcopy(spec)
    layer = spec.submodules
    layer.input_layernorm = HostNorm
    mlp = layer.mlp  # a ModuleSpec, or (megatron-core >= 0.17) a partial carrying submodules=
    mlp_submodules = mlp.submodules if hasattr(mlp, "submodules") else mlp.keywords["submodules"]
    if hasattr(mlp_submodules, "experts"):  # MoE: the router reads the normed input
        mlp_submodules.experts = _moe_experts()
        layer.pre_mlp_layernorm = HostNorm
    else:
        mlp_submodules.linear_fc1 = NormColumnParallelLinear
        layer.pre_mlp_layernorm = IdentityOp
    layer.sharded_state_dict_keys_map = {}
    return spec

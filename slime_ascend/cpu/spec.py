"""A Megatron layer spec for slime on CPU: ``--spec slime_ascend.cpu.spec get_layer_spec``.

slime trains with TransformerEngine's layer spec, which needs CUDA. Megatron's own local spec runs
on the host but does not fit slime in two ways (``slime_on_cpu.md`` rows 6 and 11):

* slime always packs a micro-batch into one THD sequence (``PackedSeqParams`` with ``cu_seqlens``),
  and Megatron's local ``DotProductAttention`` asserts ``packed_seq_params is None``;
* slime's HF converters (``hf_to_megatron``, ``megatron_to_hf``) know TE's parameter names, where the
  pre-attention and pre-MLP norms live inside the following linear as ``layer_norm_weight``
  (``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``).

So this spec is the local spec with two parts swapped: :class:`PackedSDPAttention`, which runs
``torch.nn.functional.scaled_dot_product_attention`` (causal) on each ``cu_seqlens`` segment, and
:class:`NormColumnParallelLinear`, a ``ColumnParallelLinear`` that applies its own RMSNorm/LayerNorm
first (TE's ``LayerNormColumnParallelLinear``); the separate layer norms become identities.
Dense models (Qwen2/3, Llama) only. Tensor, pipeline and data parallelism work as with TE's spec (each
rank's attention gets its own heads). Not sequence parallelism: the norms inside the linears would allow it
(a per-token norm on the rank's sequence shard, weights marked ``sequence_parallel``), but without apex
Megatron builds the final and q/k layer norms as torch norms, which refuse it. Context parallelism of 1 only
(the attention has no ring exchange). The ``cpu`` plugin refuses the others in the driver's ``parse_args``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

__all__ = ["NormColumnParallelLinear", "PackedSDPAttention", "get_layer_spec", "packed_causal_attention"]


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            cu_seqlens: torch.Tensor | None, scale: float | None = None) -> torch.Tensor:
    """Causal attention of each packed segment on its own.

    ``query`` is ``[t, heads, dim]`` and ``key``/``value`` ``[t, kv_heads, dim]`` (grouped-query heads
    are repeated); ``cu_seqlens`` holds the segment boundaries (None: one segment). Returns
    ``[t, heads, dim]``. Tokens past ``cu_seqlens[-1]`` (padding) get zeros.
    """
    t, heads, _ = query.shape
    groups = heads // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    bounds = [0, t] if cu_seqlens is None else [int(b) for b in cu_seqlens.tolist()]
    out = torch.zeros_like(query)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))  # [heads, s, dim]
        out[start:end] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1)
    return out


class PackedSDPAttention(MegatronModule):
    """Megatron core attention for THD-packed (and plain ``[s, b, h, d]``) batches, on any device."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None, **_: Any):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("slime_ascend.cpu.spec supports context parallel size 1 only "
                             f"(got CP={config.context_parallel_size})")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"slime_ascend.cpu.spec runs causal attention only, not {attn_mask_type}")
        self.softmax_scale = softmax_scale
        self.attention_dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("slime_ascend.cpu.spec: attention bias is not supported")
        if packed_seq_params is not None:  # [t, heads, dim]; Attention reshapes the result
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            return packed_causal_attention(query, key, value, cu, self.softmax_scale)
        s, b = query.shape[:2]  # [s, b, heads, dim] -> [s, b, heads * dim]
        outs = [packed_causal_attention(query[:, i], key[:, i], value[:, i], None, self.softmax_scale)
                for i in range(b)]
        return torch.stack(outs, dim=1).reshape(s, b, -1)


class NormColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` with its input norm inside, named as TE names it (``layer_norm_weight``)."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs: Any):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.rms_norm = config.normalization == "RMSNorm"
        self.eps = config.layernorm_epsilon
        self.zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        dtype = config.params_dtype
        init = torch.zeros if self.zero_centered else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init(input_size, dtype=dtype))
        setattr(self.layer_norm_weight, "sequence_parallel", config.sequence_parallel)
        if not self.rms_norm:
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=dtype))
            setattr(self.layer_norm_bias, "sequence_parallel", config.sequence_parallel)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.layer_norm_weight + 1 if self.zero_centered else self.layer_norm_weight
        if self.rms_norm:
            xf = x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (y * weight.float()).to(x.dtype)
        return F.layer_norm(x, (x.shape[-1],), weight, self.layer_norm_bias, self.eps)

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any):
        return super().forward(self._norm(input_), *args, **kwargs)


def get_layer_spec(args: Any = None, config: Any = None, vp_stage: Any = None) -> ModuleSpec:
    """The spec slime's ``--spec slime_ascend.cpu.spec get_layer_spec`` calls as
    ``spec(args, config, vp_stage)``."""
    if args is not None and getattr(args, "num_experts", None):
        raise ValueError("slime_ascend.cpu.spec: MoE models are not supported on CPU; use a dense model")
    spec = get_gpt_layer_local_spec(
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
        normalization=getattr(config, "normalization", None) or getattr(args, "normalization", None),
    )
    layer = spec.submodules
    attention = layer.self_attention.submodules
    attention.core_attention = PackedSDPAttention
    attention.linear_qkv = NormColumnParallelLinear
    layer.input_layernorm = IdentityOp
    mlp = layer.mlp  # a ModuleSpec, or (megatron-core >= 0.17) a partial carrying submodules=
    mlp_submodules = mlp.submodules if hasattr(mlp, "submodules") else mlp.keywords["submodules"]
    mlp_submodules.linear_fc1 = NormColumnParallelLinear
    layer.pre_mlp_layernorm = IdentityOp
    layer.sharded_state_dict_keys_map = {}
    return spec

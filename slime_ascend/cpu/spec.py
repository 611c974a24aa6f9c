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
Dense models (Qwen2/3, Llama) and MoE models (Qwen3-MoE: Megatron's ``MoELayer`` with
:class:`LocalGroupedLinear` experts under TE's grouped-GEMM names, expert parallelism over its all-to-all
dispatcher). Tensor, pipeline and data parallelism work as with TE's spec (each
rank's attention gets its own heads), and so does sequence parallelism: every norm is the spec's own
(:class:`HostNorm` for the block's final norm, the q/k norms and MoE's pre-MLP norm: Megatron's torch norms,
its choice without apex, refuse ``--sequence-parallel``), a per-token norm on the rank's sequence shard with
its weights marked ``sequence_parallel``, so Megatron sums their gradients over the TP group. Context
parallelism in both of slime's layouts: zig-zag (Megatron's THD RoPE already rotates at the zig-zag positions) and
``--allgather-cp``
(:class:`AllGatherCPSelfAttention` moves RoPE into the core attention); each rank's queries attend the keys and
values all-gathered over the CP group. The ``cpu`` plugin refuses the others in the driver's ``parse_args``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

__all__ = ["AllGatherCPAttention", "AllGatherCPSelfAttention", "HostNorm", "NormColumnParallelLinear",
           "PackedSDPAttention", "apply_norm", "get_layer_spec", "packed_causal_attention"]


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
    """Megatron core attention for THD-packed (and plain ``[s, b, h, d]``) batches, on any device.

    With context parallelism each rank attends its queries to the keys and values all-gathered over the CP group,
    causally by global position (:mod:`slime_ascend.cpu.cp_attention`), in slime's zig-zag layout.
    """

    cp_layout = "zigzag"

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None, **_: Any):
        super().__init__(config=config)
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if self.cp_group is None and config.context_parallel_size > 1:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group()
        self.rotary = None  # (q_freqs, k_freqs, mscale) from AllGatherCPSelfAttention, applied at global positions
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
            cp_size = 1 if self.cp_group is None else self.cp_group.size()
            if cp_size == 1 and self.rotary is None:
                return packed_causal_attention(query, key, value, cu, self.softmax_scale)
            return self._cp_forward(query, key, value, cu, cp_size)
        if self.config.context_parallel_size > 1:
            raise ValueError("slime_ascend.cpu.spec: context parallelism needs THD-packed batches (slime packs)")
        s, b = query.shape[:2]  # [s, b, heads, dim] -> [s, b, heads * dim]
        outs = [packed_causal_attention(query[:, i], key[:, i], value[:, i], None, self.softmax_scale)
                for i in range(b)]
        return torch.stack(outs, dim=1).reshape(s, b, -1)

    def _cp_forward(self, query, key, value, cu, cp_size):
        from torch.distributed.nn.functional import all_gather  # autograd: its backward sums the keys' gradients

        from .cp_attention import cp_causal_attention, global_positions

        rank = 0 if cp_size == 1 else self.cp_group.rank()
        if self.rotary is not None:  # allgather layout: RoPE by each token's position in its (global) segment
            from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

            q_freqs, k_freqs, mscale = self.rotary
            position = global_positions(self.cp_layout, cu, query.shape[0], rank, cp_size)[1].clamp(min=0)
            query, key = (x if f is None else _apply_rotary_pos_emb_bshd(
                x.unsqueeze(1), f[position], rotary_interleaved=self.config.rotary_interleaved, mscale=mscale,
            ).squeeze(1) for x, f in ((query, q_freqs), (key, k_freqs)))
        return cp_causal_attention(query, key, value, cu, layout=self.cp_layout, cp_rank=rank, cp_size=cp_size,
                                   all_gather=lambda x: list(all_gather(x, group=self.cp_group)),
                                   scale=self.softmax_scale)


class AllGatherCPAttention(PackedSDPAttention):
    """:class:`PackedSDPAttention` in slime's ``--allgather-cp`` layout (each rank a contiguous piece of the stream)."""

    cp_layout = "allgather"


class AllGatherCPSelfAttention(SelfAttention):
    """Megatron's ``SelfAttention`` that leaves RoPE to its core attention (:class:`AllGatherCPAttention`).

    Megatron's THD RoPE places each rank's tokens in the zig-zag layout (``_get_thd_freqs_on_this_cp_rank``); under
    ``--allgather-cp`` a rank holds a contiguous piece of the packed stream instead, so the core attention rotates
    queries and keys at their global positions.
    """

    def forward(self, *args: Any, rotary_pos_emb=None, **kwargs: Any):
        if rotary_pos_emb is not None and not isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = (rotary_pos_emb,) * 2
        self.core_attention.rotary = None if rotary_pos_emb is None else (*rotary_pos_emb, self._yarn_concentration_factor)
        return super().forward(*args, rotary_pos_emb=None, **kwargs)


def _norm_parameters(module: torch.nn.Module, prefix: str, size: int, config) -> None:
    """The weight (and, for LayerNorm, bias) of a norm as ``{prefix}weight`` / ``{prefix}bias``, marked
    ``sequence_parallel`` as TE marks its norms: under ``--sequence-parallel`` each TP rank sees its own tokens,
    and Megatron's ``finalize_model_grads`` then sums these gradients over the TP group."""
    zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
    init = torch.zeros if zero_centered else torch.ones
    names = ("weight",) if config.normalization == "RMSNorm" else ("weight", "bias")
    for name in names:
        param = torch.nn.Parameter((init if name == "weight" else torch.zeros)(size, dtype=config.params_dtype))
        setattr(param, "sequence_parallel", config.sequence_parallel)
        module.register_parameter(prefix + name, param)


def apply_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               zero_centered: bool = False) -> torch.Tensor:
    """RMSNorm (``bias`` None; in fp32, the result in ``x``'s dtype) or LayerNorm over the last dimension."""
    weight = weight + 1 if zero_centered else weight
    if bias is None:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (y * weight.float()).to(x.dtype)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class HostNorm(MegatronModule):
    """RMSNorm / LayerNorm (``config.normalization``) for the block's final norm, the q/k norms and MoE's pre-MLP
    norm: the norm of :class:`NormColumnParallelLinear`, as a module. Unlike Megatron's torch norms (its choice
    without apex) it runs under ``--sequence-parallel``: the norm is per token, so a rank's sequence shard is
    normed as the whole sequence would be, and its weights are marked ``sequence_parallel``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_: Any):
        super().__init__(config=config)
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"slime_ascend.cpu.spec: normalization {config.normalization!r} is not supported "
                             "(RMSNorm or LayerNorm)")
        self.eps = eps
        _norm_parameters(self, "", hidden_size, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_norm(x, self.weight, getattr(self, "bias", None), self.eps,
                          bool(getattr(self.config, "layernorm_zero_centered_gamma", False)))


class NormColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` with its input norm inside, named as TE names it (``layer_norm_weight``)."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs: Any):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.eps = config.layernorm_epsilon
        _norm_parameters(self, "layer_norm_", input_size, config)

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any):
        normed = apply_norm(input_, self.layer_norm_weight, getattr(self, "layer_norm_bias", None), self.eps,
                            bool(getattr(self.config, "layernorm_zero_centered_gamma", False)))
        return super().forward(normed, *args, **kwargs)


class LocalGroupedLinear(MegatronModule):
    """The expert linears of an MoE layer on any device, named as TE's ``GroupedLinear`` names them.

    One weight per local expert, ``weight0`` ... ``weight{n-1}``: slime's converters and its EP-global renaming
    (``named_params_and_buffers``: ``mlp.experts.linear_fc1.weight{i}``) read TE's grouped-GEMM names, not
    ``SequentialMLP``'s ``local_experts.{i}``. Megatron's ``TEGroupedMLP`` drives it (its forward has no TE
    call without FP8); like TE's, it does no communication: the token dispatcher moves tokens over EP and
    expert TP. ``parallel_mode`` ``"column"`` shards the output dimension over expert TP, ``"row"`` the input.

    Initialisation draws every global expert's whole weight, in global order, and keeps this rank's ones (its
    shard of each): the host generator then advances the same way in every expert-parallel layout, as
    Megatron's CPU initialisation (``--use-cpu-initialization``, which the ``cpu`` plugin sets) makes the
    tensor-parallel shards of one master weight. What the generator draws after the model is therefore the
    same at EP 1 and EP 2: slime's PPO critic initialises its value head (``LinearForLastLayer``, not in the HF
    checkpoint) right after building the model, so with local draws its value head, and its values, would differ
    between layouts (``tests/cpu/test_spec_moe_init.py``; ``tests/e2e/test_slime_moe_cpu.py`` compares the values).
    At EP 1 and expert TP 1 the weights are the ones a local draw gives.
    """

    parallel_mode = "column"

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config, init_method, bias: bool,
                 skip_bias_add: bool, is_expert: bool, pg_collection: Any = None, **_: Any):
        super().__init__(config=config)
        if bias:
            raise ValueError("slime_ascend.cpu.spec: expert linears with bias are not supported (drop "
                             "--add-bias-linear)")
        self._pg = pg_collection  # ep, expt_tp, expt_dp: MoELayer always passes it
        tp, tp_rank = pg_collection.expt_tp.size(), pg_collection.expt_tp.rank()
        ep_rank = pg_collection.ep.rank()
        column = self.parallel_mode == "column"
        masters = []
        with torch.no_grad():  # every global expert's whole weight, in global order (see the class doc)
            for expert in range(pg_collection.ep.size() * num_gemms):
                master = torch.empty(output_size, input_size, dtype=config.params_dtype)
                init_method(master)
                if expert // num_gemms == ep_rank:
                    masters.append(master.chunk(tp, dim=0 if column else 1)[tp_rank])
        for i in range(num_gemms):
            weight = torch.nn.Parameter(masters[i].contiguous())
            # what Megatron's expert ColumnParallelLinear / RowParallelLinear mark: sharded over expert TP,
            # gradients reduced over the expert data-parallel group (allreduce=False)
            for attr, value in (("tensor_model_parallel", True), ("partition_dim", 0 if column else 1),
                                ("partition_stride", 1), ("allreduce", not is_expert)):
                setattr(weight, attr, value)
            self.register_parameter(f"weight{i}", weight)
        self.num_gemms = num_gemms
        self.partition_dim = 0 if column else 1

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron's distributed checkpoint of the experts, as TE's grouped linear writes it: each ``weight{i}``
        a ShardedTensor of global expert ``ep_rank * n + i`` along an expert axis, sharded over expert TP and
        replicated over expert DP (slime saves ``--save`` checkpoints with it)."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton = metadata.get("singleton_local_shards", False)
        num_global = self._pg.ep.size() * self.num_gemms
        out = {}
        for i in range(self.num_gemms):
            expert = self._pg.ep.rank() * self.num_gemms + i
            offsets = sharded_offsets if singleton else (*sharded_offsets, (len(sharded_offsets), expert, num_global))
            sub = make_sharded_tensors_for_checkpoint({f"{i}.weight": getattr(self, f"weight{i}")}, "",
                                                      {f"{i}.weight": self.partition_dim}, offsets,
                                                      tp_group=self._pg.expt_tp, dp_cp_group=metadata["dp_cp_group"])
            replace_prefix_for_sharding(sub, f"{i}.", f"{expert}.{prefix}" if singleton else prefix)
            tensor = sub[f"{i}.weight"]
            tensor.replica_id = (*tensor.replica_id[:2], self._pg.expt_dp.rank())
            out[f"{prefix}weight{i}"] = tensor
        return out

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]):
        chunks = torch.split(x, list(tokens_per_expert))
        out = [F.linear(chunk, getattr(self, f"weight{i}")) for i, chunk in enumerate(chunks)]
        return torch.cat(out) if out else x.new_zeros(0, getattr(self, "weight0").shape[0]), None


class LocalRowGroupedLinear(LocalGroupedLinear):
    parallel_mode = "row"


def _moe_experts():
    """The experts of an MoE layer: Megatron's ``TEGroupedMLP`` over :class:`LocalGroupedLinear`."""
    from functools import partial

    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    return partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(linear_fc1=LocalGroupedLinear,
                                                                 linear_fc2=LocalRowGroupedLinear))


def _layer_specs(args: Any, config: Any, vp_stage: Any):
    """This stage's layer specs and the block's final norm, dense and MoE layers as ``--moe-layer-freq``
    places them (Megatron's own ``get_gpt_decoder_block_spec``); a dense model gets one layer spec."""
    normalization = getattr(config, "normalization", None) or getattr(args, "normalization", None)
    if not getattr(args, "num_experts", None):
        return get_gpt_layer_local_spec(qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
                                        normalization=normalization), None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return None, get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=normalization,
                                            vp_stage=vp_stage)


def get_layer_spec(args: Any = None, config: Any = None, vp_stage: Any = None) -> Any:
    """The spec slime's ``--spec slime_ascend.cpu.spec get_layer_spec`` calls as
    ``spec(args, config, vp_stage)``.

    A dense model gets one layer spec. An MoE model (``--num-experts``) gets this stage's block spec: its dense
    layers as a dense model's, its MoE layers (Megatron's ``MoELayer``: ``TopKRouter``, the token dispatcher
    of ``--moe-token-dispatcher-type``) with :class:`LocalGroupedLinear` experts and the pre-MLP norm kept
    as a norm (``pre_mlp_layernorm.weight``: the router reads the normed input, as in TE's MoE layer spec,
    and slime's MoE converters map that name)."""
    spec, block = _layer_specs(args, config, vp_stage)
    for spec_ in {id(s): s for s in (block.layer_specs if block is not None else [spec])}.values():
        _patch_layer(spec_.submodules, args)
    if block is None:  # the block Megatron would make of the layer spec, with its final norm a HostNorm
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

        block = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage))
    block.layer_norm = HostNorm
    return block


def _patch_layer(layer, args: Any) -> None:
    """Swap the parts of one local layer spec that do not fit slime on the host (module docstring)."""
    attention = layer.self_attention.submodules
    attention.core_attention = PackedSDPAttention
    if getattr(args, "allgather_cp", False) and getattr(args, "context_parallel_size", 1) > 1:
        attention.core_attention = AllGatherCPAttention
        layer.self_attention.module = AllGatherCPSelfAttention
    attention.linear_qkv = NormColumnParallelLinear
    for name in ("q_layernorm", "k_layernorm"):  # Megatron's torch norms refuse --sequence-parallel
        if getattr(attention, name, None) is WrappedTorchNorm:
            setattr(attention, name, HostNorm)
    if layer.pre_mlp_layernorm is WrappedTorchNorm:  # MoE: the router reads the normed input
        layer.pre_mlp_layernorm = HostNorm
    layer.input_layernorm = IdentityOp
    mlp = layer.mlp  # a ModuleSpec, or (megatron-core >= 0.17) a partial carrying submodules=
    mlp_submodules = mlp.submodules if hasattr(mlp, "submodules") else mlp.keywords["submodules"]
    if hasattr(mlp_submodules, "experts"):  # MoESubmodules
        mlp_submodules.experts = _moe_experts()
    else:
        mlp_submodules.linear_fc1 = NormColumnParallelLinear
        layer.pre_mlp_layernorm = IdentityOp
    layer.sharded_state_dict_keys_map = {}


# the attention handles slime's --allgather-cp layout itself (patches/0015: slime's DSA-only check asks the spec)
get_layer_spec.supports_allgather_cp = True

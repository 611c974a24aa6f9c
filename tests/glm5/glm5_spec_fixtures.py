"""Shared by the glm5 spec tests: the tiny GLM-5 (HF, fp32), slime's glm5 spec built on Megatron with the glm5
patches installed as the cpu plugin installs them, and slime's args for its converters."""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

import torch

from slime_ascend.glm5.tiny import TINY_GLM5_KWARGS as K

GLM5_PATCHES = ("train.glm5_kernels", "train.glm5_host_spec", "train.glm5_thd_rope", "train.glm5_index_topk",
                "train.dsa_deterministic_topk")


@contextlib.contextmanager
def glm5_patched():
    """The cpu plugin's torch patches and the glm5 patches installed (in ledger order), slime's glm5 modules
    imported fresh under them; everything removed afterwards."""
    from slime_ascend import patch
    from slime_ascend.cpu.plugin import TORCH_PATCHES

    installed = []
    for pid in TORCH_PATCHES:
        p = patch.get(pid)
        if not p.applied:
            p.install()
            installed.append(p)
    fresh = [n for n in sys.modules if n.startswith("slime_plugins.models.glm5")]
    for name in fresh:
        del sys.modules[name]
    kernels = patch.get("train.glm5_kernels")
    kernels.install()
    installed.append(kernels)
    glm5 = importlib.import_module("slime_plugins.models.glm5.glm5")
    for pid in GLM5_PATCHES[1:]:  # on the fresh module: none of them is applied to it yet
        p = patch.get(pid)
        p.install()
        installed.append(p)
    try:
        yield glm5
    finally:
        for p in reversed(installed):
            p.remove()
        for name in [n for n in sys.modules if n.startswith("slime_plugins.models.glm5")]:
            del sys.modules[name]


def slime_args(hf_dir) -> types.SimpleNamespace:
    """What slime's spec, loader and converter read of its args for the tiny GLM-5 (flags: TINY_GLM5_ARGS)."""
    return types.SimpleNamespace(
        hf_checkpoint=str(hf_dir), num_experts=K["n_routed_experts"], vocab_size=K["vocab_size"],
        padded_vocab_size=K["vocab_size"], hidden_size=K["hidden_size"], num_attention_heads=K["num_attention_heads"],
        num_query_groups=K["num_key_value_heads"], kv_channels=K["qk_nope_head_dim"], q_lora_rank=K["q_lora_rank"],
        qk_layernorm=True, normalization="RMSNorm", num_layers=K["num_hidden_layers"], allgather_cp=False,
        context_parallel_size=1)


def megatron_config():
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=K["num_hidden_layers"], hidden_size=K["hidden_size"], num_attention_heads=K["num_attention_heads"],
        ffn_hidden_size=K["intermediate_size"], normalization="RMSNorm", layernorm_epsilon=K["rms_norm_eps"],
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, qk_layernorm=True,
        hidden_dropout=0.0, attention_dropout=0.0, multi_latent_attention=True,
        q_lora_rank=K["q_lora_rank"], kv_lora_rank=K["kv_lora_rank"], qk_head_dim=K["qk_nope_head_dim"],
        qk_pos_emb_head_dim=K["qk_rope_head_dim"], v_head_dim=K["v_head_dim"], kv_channels=K["qk_nope_head_dim"],
        rope_type="yarn", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0, rotary_base=int(K["rope_parameters"]["rope_theta"]),
        num_moe_experts=K["n_routed_experts"], moe_router_topk=K["num_experts_per_tok"],
        moe_ffn_hidden_size=K["moe_intermediate_size"], moe_layer_freq=[0] + [1] * (K["num_hidden_layers"] - 1),
        moe_shared_expert_intermediate_size=K["moe_intermediate_size"] * K["n_shared_experts"],
        moe_router_score_function="sigmoid", moe_router_pre_softmax=True, moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0, moe_router_load_balancing_type="seq_aux_loss",
        moe_router_topk_scaling_factor=K["routed_scaling_factor"], moe_aux_loss_coeff=0.0, moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall", use_cpu_initialization=True, bias_activation_fusion=False,
        apply_rope_fusion=False, bf16=False)


def glm5_model(glm5, args, config):
    from megatron.core.models.gpt import GPTModel

    block = glm5.get_glm5_spec(args, config, None)
    return GPTModel(config=config, transformer_layer_spec=block, vocab_size=K["vocab_size"], max_sequence_length=256,
                    position_embedding_type="rope", rotary_base=int(K["rope_parameters"]["rope_theta"]),
                    share_embeddings_and_output_weights=False)


def packed(lengths: list[int]):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def thd_positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


class Wrap(torch.nn.Module):  # slime's names come from DDP(Float16Module(model)): "module.module."
    def __init__(self, module):
        super().__init__()
        self.module = module
        self.config = module.config

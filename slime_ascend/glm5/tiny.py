"""The tiny GLM-5 (``glm_moe_dsa``) made locally: its transformers config and its slime model flags.

Four layers (layer 1 dense, layers 2-4 MoE: four routed experts, top 2, sigmoid router with expert bias, one
shared expert), multi-latent attention with small ranks, and DeepSeek sparse attention with IndexShare: the
lightning indexer runs on layers 1 and 3 and layers 2 and 4 reuse its top-k (``index_topk_freq=2``,
``index_skip_topk_offset=1``; transformers reads ``indexer_types``, slime's spec the two numbers, and both give
the same schedule). ``index_topk`` (8) is smaller than the sequences, so the selection matters.

Three widths are GLM-5's, not tiny, because slime's parts fix them: ``kv_lora_rank`` 512 (``SparseMLA`` calls
its kernel with ``d_v=512``), ``qk_rope_head_dim`` 64 and ``index_head_dim`` 128 (slime's converters reorder the
indexer's weights in blocks of 128 with the 64 RoPE dims first, ``hf_to_megatron/deepseek.py _dsa_reorder``).

:data:`TINY_GLM5_ARGS` is the counterpart of slime's ``scripts/models/glm5.2-744B-A40B.sh`` for this model
(slime's own spec, ``--spec slime_plugins.models.glm5.glm5 get_glm5_spec``); the ``cpu`` plugin adds its host
flags. No slime import here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TINY_GLM5_ARGS", "TINY_GLM5_KWARGS", "tiny_glm5_config"]

NUM_LAYERS = 4

TINY_GLM5_KWARGS: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=NUM_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    routed_scaling_factor=2.5,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    mlp_layer_types=["dense"] + ["sparse"] * (NUM_LAYERS - 1),
    q_lora_rank=32,
    kv_lora_rank=512,
    qk_nope_head_dim=16,
    qk_rope_head_dim=64,
    head_dim=64,
    v_head_dim=16,
    index_topk=8,
    index_head_dim=128,
    index_n_heads=4,
    index_topk_freq=2,
    index_skip_topk_offset=1,
    indexer_types=["full", "shared"] * (NUM_LAYERS // 2),
    # GLM-5's config.json: the indexer's RoPE rotates adjacent pairs (SGLang: is_neox_style=False; slime's spec
    # always does); transformers ignores the flag, the torch engine honours it (rollout/torch_engine/glm5.py)
    indexer_rope_interleave=True,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_glm5_config(**overrides: Any):
    """The tiny GLM-5's ``GlmMoeDsaConfig`` (:data:`TINY_GLM5_KWARGS`, updated with ``overrides``)."""
    from transformers import GlmMoeDsaConfig

    kwargs = dict(TINY_GLM5_KWARGS)
    kwargs.update(overrides)
    config = GlmMoeDsaConfig(**kwargs)
    for name in ("index_topk_freq", "index_skip_topk_offset"):  # slime's spec reads these from config.json
        setattr(config, name, kwargs[name])
    return config


_K = TINY_GLM5_KWARGS

#: slime's model flags for the tiny GLM-5 (``scripts/models/glm5*.sh`` shape; the ``cpu`` plugin's host flags,
#: e.g. ``--transformer-impl local``, come from ``slime-ascend config cpu --flags``, with ``--spec`` left as
#: this one: the glm5 patches give slime's spec its host parts).
TINY_GLM5_ARGS: tuple[str, ...] = (
    "--spec", "slime_plugins.models.glm5.glm5", "get_glm5_spec",
    "--moe-layer-freq", f"[0]*1+[1]*{NUM_LAYERS - 1}",
    "--num-experts", str(_K["n_routed_experts"]),
    "--moe-shared-expert-intermediate-size", str(_K["moe_intermediate_size"] * _K["n_shared_experts"]),
    "--moe-router-topk", str(_K["num_experts_per_tok"]),
    "--moe-ffn-hidden-size", str(_K["moe_intermediate_size"]),
    "--moe-router-score-function", "sigmoid",
    "--moe-router-pre-softmax",
    "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "0",
    "--moe-router-load-balancing-type", "seq_aux_loss",
    "--moe-router-topk-scaling-factor", str(_K["routed_scaling_factor"]),
    "--moe-aux-loss-coeff", "0",
    "--moe-router-dtype", "fp32",
    "--moe-token-dispatcher-type", "alltoall",
    "--num-layers", str(NUM_LAYERS),
    "--hidden-size", str(_K["hidden_size"]),
    "--ffn-hidden-size", str(_K["intermediate_size"]),
    "--num-attention-heads", str(_K["num_attention_heads"]),
    "--disable-bias-linear",
    "--swiglu",
    "--untie-embeddings-and-output-weights",
    "--position-embedding-type", "rope",
    "--no-position-embedding",
    "--normalization", "RMSNorm",
    "--norm-epsilon", str(_K["rms_norm_eps"]),
    "--qk-layernorm",
    "--multi-latent-attention",
    # slime's MLA unpacks (embedding, mscale) from the rotary module: YaRN, here with factor 1 (plain RoPE)
    "--rope-type", "yarn", "--rotary-scaling-factor", "1", "--mscale", "1", "--mscale-all-dim", "0",
    "--q-lora-rank", str(_K["q_lora_rank"]),
    "--kv-lora-rank", str(_K["kv_lora_rank"]),
    "--qk-head-dim", str(_K["qk_nope_head_dim"]),
    "--v-head-dim", str(_K["v_head_dim"]),
    "--kv-channels", str(_K["qk_nope_head_dim"]),
    "--qk-pos-emb-head-dim", str(_K["qk_rope_head_dim"]),
    "--vocab-size", str(_K["vocab_size"]),
    "--rotary-base", str(int(_K["rope_parameters"]["rope_theta"])),
)

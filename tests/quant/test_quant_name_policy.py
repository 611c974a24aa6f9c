"""Which HF names are quantised."""

from __future__ import annotations

import pytest

from slime_ascend.quant.name_policy import matches_rule, should_quantize

QUANTIZED = [
    "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
    "model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.up_proj.weight", "model.layers.3.mlp.down_proj.weight",
    "model.layers.3.mlp.experts.17.gate_proj.weight", "model.layers.3.mlp.experts.17.down_proj.weight",
    "model.layers.3.mlp.shared_experts.up_proj.weight", "model.layers.3.mlp.shared_expert.down_proj.weight",
    "model.layers.2.self_attn.q_a_proj.weight", "model.layers.2.self_attn.q_b_proj.weight",
    "model.layers.2.self_attn.kv_a_proj_with_mqa.weight", "model.layers.2.self_attn.kv_b_proj.weight",
    "model.layers.2.self_attn.indexer.wq_b.weight", "model.layers.2.self_attn.indexer.wk.weight",
    "model.language_model.layers.0.linear_attn.in_proj_qkvz.weight",
    "model.layers.1.block_sparse_moe.experts.0.w1.weight",
]
KEPT = [
    "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
    "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
    "model.layers.0.self_attn.q_norm.weight", "model.layers.3.mlp.gate.weight",
    "model.layers.3.mlp.shared_expert_gate.weight", "model.layers.3.mlp.gate.e_score_correction_bias",
    "model.layers.2.self_attn.kv_a_layernorm.weight", "model.layers.2.self_attn.indexer.weights_proj.weight",
    "model.layers.61.eh_proj.weight", "model.layers.0.self_attn.q_proj.bias", "visual.blocks.0.attn.qkv.weight",
]


@pytest.mark.parametrize("name", QUANTIZED)
def test_default_policy_quantises_decoder_linears(name):
    assert should_quantize(name, 2)
    assert not should_quantize(name, 1)


@pytest.mark.parametrize("name", KEPT)
def test_default_policy_keeps_the_rest(name):
    assert not should_quantize(name, 2)


def test_stacked_3d_experts():
    assert should_quantize("model.layers.0.mlp.experts.gate_up_proj.weight", 3)


def test_ignore_list_mode_and_rules():
    ignore = ["lm_head", "re:.*mlp\\.gate$", "model.layers.0.self_attn"]
    assert should_quantize("model.layers.1.mlp.gate_proj.weight", 2, ignore)
    assert should_quantize("model.layers.3.mlp.shared_expert_gate.weight", 2, ignore)  # CT semantics: a Linear
    assert not should_quantize("model.layers.3.mlp.gate.weight", 2, ignore)
    assert not should_quantize("model.layers.0.self_attn.q_proj.weight", 2, ignore)
    assert not should_quantize("lm_head.weight", 2, [])
    assert not should_quantize("model.embed_tokens.weight", 2, [])
    assert not should_quantize("model.layers.1.mlp.gate_proj.weight", 2, None, extra_ignore=["re:.*layers\\.1\\."])


def test_matches_rule():
    assert matches_rule("model.layers.3.mlp.gate", "mlp.gate")
    assert not matches_rule("model.layers.3.mlp.gate_proj", "mlp.gate")
    assert matches_rule("model.layers.3.mlp.gate_proj", "model.layers.3")
    assert not matches_rule("model.layers.30.mlp.gate_proj", "model.layers.3")
    assert matches_rule("lm_head", "lm_head")

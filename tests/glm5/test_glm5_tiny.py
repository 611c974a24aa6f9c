"""The tiny GLM-5: its transformers config (IndexShare schedule the same on both sides) and its slime flags,
which Megatron's own parser reads into the model the spec tests build."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from slime_ascend.glm5.tiny import TINY_GLM5_ARGS, TINY_GLM5_KWARGS, tiny_glm5_config


def test_indexer_types_follow_slimes_index_share_rule_and_reach_config_json(tmp_path):
    from transformers import AutoModelForCausalLM

    config = tiny_glm5_config()
    freq, offset = config.index_topk_freq, config.index_skip_topk_offset
    # slime's glm5.is_skip_topk_layer for Megatron's 1-indexed layer numbers
    slime_rule = ["shared" if max(n - offset, 0) % freq else "full" for n in range(1, config.num_hidden_layers + 1)]
    assert config.indexer_types == slime_rule == ["full", "shared", "full", "shared"]
    assert config.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    assert config.index_topk < 16  # smaller than the sequences the tests and the demo use
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["index_topk_freq"], saved["index_skip_topk_offset"]) == (freq, offset)  # what get_glm5_spec reads


@pytest.mark.slime
def test_megatron_reads_the_flags_as_the_model_the_spec_tests_build():
    pytest.importorskip("megatron.training.arguments")
    from megatron.training.arguments import add_megatron_arguments

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from glm5_spec_fixtures import megatron_config

    args, _ = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_known_args(
        list(TINY_GLM5_ARGS))
    assert args.spec == ["slime_plugins.models.glm5.glm5", "get_glm5_spec"]
    config = megatron_config()
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                 "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "moe_ffn_hidden_size", "moe_router_topk",
                 "moe_shared_expert_intermediate_size", "moe_router_score_function", "moe_router_topk_scaling_factor",
                 "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim", "moe_router_pre_softmax",
                 "moe_router_enable_expert_bias", "moe_router_dtype"):
        assert getattr(args, name) == getattr(config, name), name
    assert args.num_experts == config.num_moe_experts == TINY_GLM5_KWARGS["n_routed_experts"]
    assert args.moe_layer_freq == config.moe_layer_freq and args.layernorm_epsilon == config.layernorm_epsilon
    assert args.rotary_base == config.rotary_base and args.multi_latent_attention

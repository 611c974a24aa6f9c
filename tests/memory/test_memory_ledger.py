"""The memory ledger's formulas against hand-computed numbers and slow, obvious computations."""

from __future__ import annotations

import math

import pytest

from conftest import need
from slime_ascend.memory.ledger import (
    CATEGORIES, Layout, ModelShape, build_ledger, layer_activation_bytes, layer_params, model_state_bytes_per_param,
    param_count, param_shapes,
)
from slime_ascend.rollout.torch_engine.model import TINY_QWEN3_KWARGS

TINY = dict(TINY_QWEN3_KWARGS, model_type="qwen3")
QWEN3_8B = dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                tie_word_embeddings=False)


def test_tiny_param_count_by_hand_and_by_shapes():
    m = ModelShape.from_hf(TINY)
    # per layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 + q/k norm 2*16 + 2 norms 2*64 + MLP 3*64*128
    per_layer = 4096 + 2048 + 2048 + 4096 + 32 + 128 + 24576
    assert per_layer == 37024
    assert layer_params(m, 0).dense == per_layer and layer_params(m, 0).expert == 0
    total = 2 * per_layer + 1024 * 64 * 2 + 64
    assert param_count(m) == total == 205184
    assert sum(math.prod(s) for _, s in param_shapes(m)) == total


def test_tiny_param_count_matches_transformers():
    need("transformers")
    from slime_ascend.rollout.torch_engine.model import load_model

    assert load_model(None).num_parameters() == param_count(ModelShape.from_hf(TINY))


def test_moe_and_mla_counts_match_transformers_state_dict():
    transformers = need("transformers")
    from transformers import AutoModelForCausalLM

    cfgs = [transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        mlp_only_layers=[0])]
    if hasattr(transformers, "DeepseekV3Config"):
        cfgs.append(transformers.DeepseekV3Config(
            vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1))
    for cfg in cfgs:
        model = AutoModelForCausalLM.from_config(cfg)
        m = ModelShape.from_hf(cfg.to_dict())
        # state_dict: checkpoint tensors (DeepSeek's e_score_correction_bias is a buffer, not a parameter)
        assert param_count(m) == sum(v.numel() for v in model.state_dict().values()), cfg.model_type
        assert sum(math.prod(s) for _, s in param_shapes(m)) == param_count(m)


def test_qwen3_8b_params():
    m = ModelShape.from_hf(QWEN3_8B)
    assert param_count(m) == 8_190_735_360  # Qwen3-8B: 8.19e9
    assert sum(math.prod(s) for _, s in param_shapes(m)) == param_count(m)


def test_model_state_table_of_megatron():
    # Megatron dist_optimizer.md: bf16/fp32 grads 18 vs 6 + 12/d; fp16/fp16 20 vs 4 + 16/d; fp32 16 vs 8 + 8/d
    for pd, gd, full, dist in (("bf16", "fp32", 18, (6, 12)), ("fp16", "fp16", 20, (4, 16)), ("fp32", "fp32", 16, (8, 8))):
        assert sum(model_state_bytes_per_param(pd, gd, 1).values()) == full
        assert sum(model_state_bytes_per_param(pd, gd, 8).values()) == pytest.approx(dist[0] + dist[1] / 8)


def test_activation_formula_reduces_to_korthikanti():
    # GPT-like: a*d = h, g = a, SwiGLU with 3*ffn = 8h (as GeLU's 4h + 4h), dropout, eager, 2-byte -> sbh(34 + 5as/h)
    h, a, s = 96, 4, 512
    m = ModelShape(hidden=h, layers=1, heads=a, kv_heads=a, head_dim=h // a, ffn=8 * h // 3, vocab=100)
    lay = Layout(seq_length=s, dropout=True, attention="eager", max_tokens_per_gpu=s)
    assert layer_activation_bytes(m, lay, False, s) == pytest.approx(s * h * (34 + 5 * a * s / h))
    # TP + SP: everything / t; TP without SP: sbh(10 + 24/t + 5as/(ht))
    assert layer_activation_bytes(m, Layout(tp=4, seq_length=s, dropout=True, attention="eager"), False, s) == \
        pytest.approx(s * h * (34 + 5 * a * s / h) / 4)
    no_sp = Layout(tp=4, seq_length=s, dropout=True, attention="eager", sequence_parallel=False)
    assert layer_activation_bytes(m, no_sp, False, s) == pytest.approx(s * h * (10 + 24 / 4 + 5 * a * s / (h * 4)))
    # selective recompute drops the s^2 terms: 34sbh
    sel = Layout(seq_length=s, dropout=True, attention="eager", recompute="selective")
    assert layer_activation_bytes(m, sel, False, s) == 34 * s * h


def test_tiny_ledger_numbers():
    T = 1000
    led = build_ledger(TINY, Layout(max_tokens_per_gpu=T, dp=4, kv_cache_tokens=1000, margin=0.0))
    by = {(e.role, e.name): e for e in led.entries}
    P = 205184
    assert by["actor", "params (bf16)"].bytes == 2 * P
    assert by["actor", "grads (fp32 main_grad)"].bytes == 4 * P
    assert by["actor", "fp32 main params (shard 1/4)"].bytes == P
    assert by["actor", "Adam exp_avg + exp_avg_sq (shard 1/4)"].bytes == 2 * P
    # the loss path: fp32 logits (Float16Module's cast), slime's fp32 softmax, its entropy product: 3 x 4 B x V
    assert by["actor", "logits fp32 [tokens, vocab/TP] (the loss input)"].bytes == 4 * 1024 * T
    assert by["actor", "softmax fp32 (saved for the log-prob backward)"].bytes == 4 * 1024 * T
    assert by["actor", "entropy temporary softmax x logits fp32"].bytes == 4 * 1024 * T
    # KV: 2 * layers 2 * kv heads 2 * head_dim 16 * 2 B = 256 B per token
    assert by["rollout", "KV cache (1,000 tokens, bf16)"].bytes == 256 * 1000
    # one weight-sync bucket holds the whole tiny model in bf16
    assert by["actor", "weight-sync bucket: TP/EP-gathered full-size bf16 tensors"].bytes == 2 * P
    assert {e.category for e in led.entries} <= set(CATEGORIES)
    # the actor's peak is the largest phase sum of its device objects
    train = sum(e.bytes for e in led.role_entries("actor") if e.lifetime in ("whole run", "train step"))
    assert led.peak("actor") == (train, "train step")


def test_full_recompute_and_pp_and_margin():
    big = build_ledger(QWEN3_8B, Layout(tp=2, dp=4, max_tokens_per_gpu=8192, margin=0.1, kv_cache_tokens=1000))
    full = build_ledger(QWEN3_8B, Layout(tp=2, dp=4, max_tokens_per_gpu=8192, recompute="full", margin=0.1,
                                         kv_cache_tokens=1000))
    layers = lambda led: sum(e.bytes for e in led.entries if e.role == "actor" and "layer" in e.name  # noqa: E731
                             and e.category == "saved activations")
    assert layers(full) < layers(big) / 5
    # full recompute: 2sbh/t per layer = 2 B * 4096 * 8192 / 2 * 36 layers
    inputs = [e for e in full.entries if e.name.startswith("layer inputs")][0]
    assert inputs.bytes == 2 * 4096 * 8192 / 2 * 36
    margin = [e for e in big.entries if e.role == "actor" and e.category == "allocator margin"][0]
    assert margin.bytes == pytest.approx(0.1 * (big.peak("actor")[0] - margin.bytes))
    pp = build_ledger(QWEN3_8B, Layout(tp=2, pp=4, dp=1, max_tokens_per_gpu=8192, kv_cache_tokens=1000))
    assert pp.total("actor", "model state") < big.total("actor", "model state")


def test_dsa_index_cache_and_sync_formats():
    cfg = dict(model_type="deepseek_v32", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=128, moe_intermediate_size=32, vocab_size=512, n_routed_experts=8,
               num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
               qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_n_heads=4, index_head_dim=32)
    led = build_ledger(cfg, Layout(kv_cache_tokens=100, sync_format="int4-group"))
    idx = [e for e in led.entries if e.name.startswith("DSA index key cache")][0]
    assert idx.bytes == 100 * 2 * (32 + 4)
    kv = [e for e in led.entries if e.name.startswith("KV cache")][0]
    assert kv.bytes == 100 * 2 * (16 + 8) * 2  # MLA latent, bf16
    w = {f: build_ledger(cfg, Layout(kv_cache_tokens=100, sync_format=f)).total("rollout", "model state")
         for f in ("none", "fp8-block", "int8-w8a8", "int4-group")}
    assert w["none"] > w["int8-w8a8"] > w["int4-group"] and w["none"] > w["fp8-block"]


@pytest.mark.parametrize("kw, flag", [(dict(tp=0), "--tp"), (dict(recompute="some"), "--recompute"),
                                      (dict(sync_format="int3"), "--sync-format"), (dict(mem_fraction=1.5), "--mem-fraction"),
                                      (dict(tp=3), "--tp"), (dict(ep=2), "--ep")])
def test_bad_layout_names_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag) as ei:
        build_ledger(TINY, Layout(**kw))
    assert "Fix:" in str(ei.value)


def test_bad_config():
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_hf({"num_hidden_layers": 2})


def test_cpu_kernels_tiny_by_hand():
    """The cpu plugin's spec (unfused kernels), per token of the tiny Qwen3 (h 64, 4 heads, 2 KV heads, d 16,
    ffn 128, V 1024, bf16), counted by hand from what each op saves."""
    T = 2048
    m = ModelShape.from_hf(TINY)
    lay = Layout(max_tokens_per_gpu=T, kernels="cpu", reference=False, margin=0.0, kv_cache_tokens=1)
    per_layer = (2 * 8 * 64      # two RMSNorms inside the fc1/qkv linears: fp32 upcast + fp32 normalised
                 + 2 * 64        # qkv linear input
                 + 2 * 3 * 64    # q and the k, v repeated to 4 heads (4 x 16), saved by SDPA
                 + 2 * 64        # SDPA's own output
                 + 4 * 2 * 16    # RoPE cos + sin, for q and for k
                 + 8 * (64 + 32)  # q/k norms (torch.nn.RMSNorm): fp32 upcast + fp32 normalised
                 + 4 * 4         # SDPA log-sum-exp, fp32 per head
                 + 2 * 64        # output projection input
                 + 2 * 64        # fc1 input
                 + 2 * 4 * 128)  # fc1 out (2 x 128), silu out, the product (fc2 input)
    assert per_layer == 3856
    assert layer_activation_bytes(m, lay, False, T) == per_layer * T
    led = build_ledger(TINY, lay)
    step = led.total("actor", lifetime="train step")
    by_hand = (2 * per_layer + (8 + 2) * 64 + 3 * 4 * 1024 + 2 * max(2 * 3 * 128, 2 * 64 * 4) + 32) * T
    assert step == by_hand
    assert not [e for e in led.entries if e.name == "embedding output"]  # the first norm keeps only its fp32 copy
    # the fused kernels save less per layer: 1,872 B per token
    assert layer_activation_bytes(m, Layout(max_tokens_per_gpu=T), False, T) == 1872 * T


def test_cpu_kernels_refuse_what_the_cpu_spec_does_not_run():
    with pytest.raises(ValueError, match="--kernels cpu") as ei:
        build_ledger(QWEN3_8B, Layout(kernels="cpu", tp=2, kv_cache_tokens=1))
    assert "Fix:" in str(ei.value)
    with pytest.raises(ValueError, match="--kernels 'gpu' is not known"):
        build_ledger(TINY, Layout(kernels="gpu"))


def test_qat_rows_hold_the_fake_quant_copies_by_hand():
    """qat on the tiny Qwen3 (one stage, TP 1, fp32): per layer q 64x64, k, v 64x32, o 64x64, gate/up 128x64,
    down 64x128 are fake-quantised (12288 + 24576 = 36864 elements); embedding, norms, lm_head are not."""
    m = ModelShape.from_hf(TINY)
    base = build_ledger(m, Layout(param_dtype="fp32", micro_batch_size=1, seq_length=64, num_microbatches=2))
    led = build_ledger(m, Layout(param_dtype="fp32", micro_batch_size=1, seq_length=64, num_microbatches=2,
                                 qat="int4-group"))
    rows = {e.name: e for e in led.role_entries("actor") if e.name.startswith("QAT")}
    saved = rows["QAT fake-quant weights (int4-group, fp32) saved for backward"]
    assert saved.bytes == 2 * 36864 * 4 * 1 and saved.lifetime == "train step"  # 1 micro-batch in flight at PP 1
    largest = 128 * 64
    work = rows["QAT quantiser temporaries (int4-group)"]
    assert work.bytes == largest * (1 + 4 / 128) + 4 * largest and work.category == "operator workspace"
    one = rows["QAT fake-quant copy of one weight + quantiser temporaries (int4-group)"]
    assert one.bytes == work.bytes + 4 * largest and one.lifetime == "log-prob forward"
    # the master weights are the params row, unchanged; the copies add to the train step's peak
    assert [e.bytes for e in led.role_entries("actor") if e.category == "model state"] == \
        [e.bytes for e in base.role_entries("actor") if e.category == "model state"]
    assert led.total("actor", "saved activations") == base.total("actor", "saved activations") + saved.bytes
    full = build_ledger(m, Layout(param_dtype="bf16", micro_batch_size=1, seq_length=64, recompute="full",
                                  qat="fp8-block"))
    saved = next(e for e in full.role_entries("actor") if e.name.startswith("QAT fake-quant weights"))
    assert saved.bytes == 36864 * 2  # one layer's copies, recomputed in its backward
    assert not [e for e in base.role_entries("actor") if e.name.startswith("QAT")]
    with pytest.raises(ValueError, match="--qat 'int3' is not known"):
        build_ledger(m, Layout(qat="int3"))


MTP_CFG = dict(model_type="deepseek_v3", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, vocab_size=512,
               n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
               kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_nextn_predict_layers=1)


def test_an_mtp_layer_is_a_decoder_layer_of_the_moe_kind_plus_its_projection_and_norms():
    """DeepSeek-V3's MTP layer (GLM-5 follows it): transformers' own decoder layer at a MoE index, counted from its
    parameters, plus eh_proj (2h -> h) and the enorm, hnorm and shared_head norms."""
    transformers = need("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    from slime_ascend.memory.ledger import mtp_layer_params

    cfg = transformers.DeepseekV3Config(**{k: v for k, v in MTP_CFG.items() if k != "model_type"},
                                        n_group=1, topk_group=1)
    layer = DeepseekV3DecoderLayer(cfg, layer_idx=2)  # past first_k_dense_replace: MoE
    by_torch = sum(v.numel() for v in layer.state_dict().values()) + 2 * 64 * 64 + 3 * 64
    m = ModelShape.from_hf(MTP_CFG)
    assert m.mtp_layers == 1
    mtp = mtp_layer_params(m)
    assert mtp.dense + mtp.expert == by_torch
    assert param_count(m) == param_count(ModelShape.from_hf({**MTP_CFG, "num_nextn_predict_layers": 0}))  # not in it


def test_mtp_rows_where_the_layout_puts_them():
    from slime_ascend.memory.ledger import mtp_layer_params

    m = ModelShape.from_hf(MTP_CFG)
    mtp = mtp_layer_params(m)
    base = build_ledger(MTP_CFG, Layout(kv_cache_tokens=100, max_tokens_per_gpu=256))
    trained = build_ledger(MTP_CFG, Layout(kv_cache_tokens=100, max_tokens_per_gpu=256, mtp_training=True))
    # model state: the MTP layer's parameters on the (one, last) stage, at the same bytes per parameter (bf16 params,
    # fp32 grads, fp32 main params and Adam: 18 B with DP 1)
    assert trained.total("actor", "model state") - base.total("actor", "model state") == pytest.approx(
        (mtp.dense + mtp.expert) * 18)
    names = {e.name: e.bytes for e in trained.entries if e.role == "actor"}
    lay = Layout(kv_cache_tokens=100, max_tokens_per_gpu=256)
    assert names["MTP layers' activations (1 x 1 micro-batch)"] == pytest.approx(
        layer_activation_bytes(m, lay, True, 256) + 2 * 2 * 64 * 256)
    assert names["MTP logits + softmax fp32 (the MTP loss input)"] == 8 * 512 * 256
    assert not any(e.name.startswith("MTP") for e in base.entries)
    # the engines' NEXTN draft: bf16 weights and their own KV over the pool's tokens (MLA latent, one layer)
    drafting = build_ledger(MTP_CFG, Layout(kv_cache_tokens=100, max_tokens_per_gpu=256, rollout_mtp=True))
    rows = {e.name: e.bytes for e in drafting.entries if e.role == "rollout"}
    assert rows["MTP draft weights (1 layer, bf16) / engine TP 1"] == (mtp.dense + mtp.expert) * 2
    assert rows["MTP draft KV cache (100 tokens, 1 layer)"] == 100 * (16 + 8) * 2
    with pytest.raises(ValueError, match="--mtp-training: the model config has no MTP layers"):
        build_ledger(TINY, Layout(mtp_training=True))

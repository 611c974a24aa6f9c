"""slime_ascend.cpu.spec: packed causal attention against a slow reference, and the layer spec's
TE-style parameter names on a real Megatron GPTModel."""

import math
import types

import pytest
import torch

from conftest import need, single_process_megatron

pytestmark = pytest.mark.slime

need("megatron.core")  # slime_ascend.cpu.spec builds on it, imported below at collection

from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from slime_ascend.cpu import spec  # noqa: E402


def reference_attention(q, k, v, cu_seqlens, scale=None):
    """Per segment, per head, per query token: softmax over the keys at or before it (float64)."""
    q, k, v = q.double(), k.double(), v.double()
    t, heads, dim = q.shape
    groups = heads // k.shape[1]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    bounds = [0, t] if cu_seqlens is None else [int(b) for b in cu_seqlens]
    out = torch.zeros(t, heads, dim, dtype=torch.float64)
    for start, end in zip(bounds[:-1], bounds[1:]):
        for h in range(heads):
            kv = h // groups
            for i in range(start, end):
                scores = [float(q[i, h] @ k[j, kv]) * scale for j in range(start, i + 1)]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                for w, j in zip(weights, range(start, i + 1)):
                    out[i, h] += (w / total) * v[j, kv]
    return out


def _qkv(t, heads, kv_heads, dim, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, heads, dim, generator=g, dtype=dtype),
            torch.randn(t, kv_heads, dim, generator=g, dtype=dtype),
            torch.randn(t, kv_heads, dim, generator=g, dtype=dtype))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    padding=st.integers(0, 3),
    heads_kv=st.sampled_from([(4, 2), (4, 4), (2, 1)]),
    seed=st.integers(0, 2**16),
)
def test_packed_attention_matches_reference(lengths, padding, heads_kv, seed):
    heads, kv_heads = heads_kv
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    t = int(cu[-1]) + padding
    assume(t > 0)  # no tokens: nothing to attend (hypothesis draws another case)
    q, k, v = _qkv(t, heads, kv_heads, 8, seed)
    out = spec.packed_causal_attention(q, k, v, cu)
    expected = reference_attention(q, k, v, cu.tolist())
    assert out.shape == (t, heads, 8)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)
    assert torch.count_nonzero(out[int(cu[-1]):]) == 0  # padding tokens get zeros


def test_gqa_empty_segment_and_padding_fixed_case():
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)  # an empty middle segment
    q, k, v = _qkv(9, 4, 2, 8, seed=1)  # two padding tokens after cu[-1]
    out = spec.packed_causal_attention(q, k, v, cu)
    torch.testing.assert_close(out, reference_attention(q, k, v, cu.tolist()), rtol=1e-9, atol=1e-9)
    assert torch.equal(out[7:], torch.zeros(2, 4, 8, dtype=torch.float64))
    # segments do not see each other: changing segment 2 leaves segment 1 as it was
    k2 = k.clone()
    k2[3:7] += 5
    torch.testing.assert_close(spec.packed_causal_attention(q, k2, v, cu)[:3], out[:3])
    # causal: the first token of a segment attends to itself only
    torch.testing.assert_close(out[3, 0], v[3, 0])
    torch.testing.assert_close(out[3, 1], v[3, 0])  # head 1 shares kv head 0
    torch.testing.assert_close(out[3, 2], v[3, 1])


def test_no_cu_seqlens_is_one_segment_and_scale_is_used():
    q, k, v = _qkv(6, 4, 2, 8, seed=2)
    torch.testing.assert_close(spec.packed_causal_attention(q, k, v, None),
                               reference_attention(q, k, v, None), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(spec.packed_causal_attention(q, k, v, None, scale=0.1),
                               reference_attention(q, k, v, None, scale=0.1), rtol=1e-9, atol=1e-9)


def test_float32_inputs():
    q, k, v = _qkv(7, 4, 2, 16, seed=3, dtype=torch.float32)
    cu = torch.tensor([0, 2, 7])
    out = spec.packed_causal_attention(q, k, v, cu)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, [0, 2, 7]), rtol=1e-5, atol=1e-5)


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                  normalization="RMSNorm", use_cpu_initialization=True, bf16=False)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def test_packed_sdp_attention_module_thd_and_sbhd():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    config = _config()
    attention = spec.PackedSDPAttention(config, 1, AttnMaskType.causal, "self")
    q, k, v = _qkv(7, 4, 2, 16, seed=4)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4, max_seqlen_kv=4)
    torch.testing.assert_close(attention(q, k, v, None, packed_seq_params=params),
                               reference_attention(q, k, v, [0, 3, 7]), rtol=1e-9, atol=1e-9)
    # padded boundaries win over the unpadded ones when given
    padded = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=torch.tensor([0, 7]),
                             max_seqlen_q=7, max_seqlen_kv=7)
    torch.testing.assert_close(attention(q, k, v, None, packed_seq_params=padded),
                               reference_attention(q, k, v, [0, 7]), rtol=1e-9, atol=1e-9)
    # [s, b, heads, dim] -> [s, b, heads * dim], each batch row on its own
    qb, kb, vb = (torch.stack([x, x.flip(0)], dim=1) for x in (q, k, v))
    out = attention(qb, kb, vb, None)
    assert out.shape == (7, 2, 64)
    torch.testing.assert_close(out[:, 1].reshape(7, 4, 16), reference_attention(q.flip(0), k.flip(0), v.flip(0), None),
                               rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="causal"):
        spec.PackedSDPAttention(config, 1, AttnMaskType.no_mask, "self")


def test_layer_spec_builds_gpt_with_te_parameter_names():
    from megatron.core.models.gpt import GPTModel

    config = _config()
    with single_process_megatron():
        layer_spec = spec.get_layer_spec(types.SimpleNamespace(num_experts=None, qk_layernorm=False), config, None)
        model = GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=128, max_sequence_length=32)
    names = {n for n, _ in model.named_parameters()}
    for layer in (0, 1):
        assert f"decoder.layers.{layer}.self_attention.linear_qkv.layer_norm_weight" in names
        assert f"decoder.layers.{layer}.mlp.linear_fc1.layer_norm_weight" in names
        assert f"decoder.layers.{layer}.self_attention.linear_qkv.weight" in names
    assert not [n for n in names if "input_layernorm" in n or "pre_mlp_layernorm" in n]
    assert not [n for n in names if "layer_norm_bias" in n]  # RMSNorm has no bias
    layer0 = model.decoder.layers[0]
    assert isinstance(layer0.self_attention.linear_qkv, spec.NormColumnParallelLinear)
    assert isinstance(layer0.self_attention.core_attention, spec.PackedSDPAttention)


def test_norm_column_parallel_linear_applies_rmsnorm_then_linear():
    config = _config()
    with single_process_megatron():
        linear = spec.NormColumnParallelLinear(64, 32, config=config, init_method=config.init_method, bias=False,
                                               gather_output=False, skip_bias_add=True)
    with torch.no_grad():
        linear.layer_norm_weight.copy_(torch.linspace(0.5, 1.5, 64))
    x = torch.randn(5, 1, 64)
    out, bias = linear(x)
    expected_norm = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon) * linear.layer_norm_weight
    torch.testing.assert_close(out, expected_norm @ linear.weight.t(), rtol=1e-5, atol=1e-5)
    assert bias is None


def test_norm_column_parallel_linear_layernorm_has_bias():
    config = _config(normalization="LayerNorm")
    with single_process_megatron():
        linear = spec.NormColumnParallelLinear(64, 16, config=config, init_method=config.init_method, bias=False,
                                               gather_output=False, skip_bias_add=True)
    with torch.no_grad():
        linear.layer_norm_bias.copy_(torch.linspace(-1, 1, 64))
    x = torch.randn(3, 1, 64)
    out, _ = linear(x)
    normed = torch.nn.functional.layer_norm(x, (64,), linear.layer_norm_weight, linear.layer_norm_bias,
                                            config.layernorm_epsilon)
    torch.testing.assert_close(out, normed @ linear.weight.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_host_norm_is_the_per_token_norm_and_marks_its_weights_for_sequence_parallelism(normalization):
    config = _config(normalization=normalization)
    norm = spec.HostNorm(config, 16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 16))
        if normalization == "LayerNorm":
            norm.bias.copy_(torch.linspace(-1, 1, 16))
    x = torch.randn(5, 2, 16, dtype=torch.float64).float()
    xd, w = x.double(), norm.weight.double()
    if normalization == "RMSNorm":
        expected = xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w
        assert [n for n, _ in norm.named_parameters()] == ["weight"]
    else:
        centred = xd - xd.mean(-1, keepdim=True)
        expected = centred / (centred.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w + norm.bias.double()
        assert [n for n, _ in norm.named_parameters()] == ["weight", "bias"]
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-5, atol=1e-5)
    # per token: a token normed alone is the token normed in the batch (a sequence shard needs no exchange)
    torch.testing.assert_close(norm(x[2:3]), norm(x)[2:3])
    assert all(p.sequence_parallel is False for p in norm.parameters())
    marked = spec.HostNorm(_config(normalization=normalization, tensor_model_parallel_size=2,
                                   sequence_parallel=True), 16)
    assert all(p.sequence_parallel is True for p in marked.parameters())


def test_every_norm_of_the_dense_spec_is_the_specs_own_under_sequence_parallelism():
    """Megatron's torch norms (its choice without apex) assert ``not sequence_parallel``; the spec's build."""
    from megatron.core.models.gpt import GPTModel

    config = _config(tensor_model_parallel_size=2, sequence_parallel=True, qk_layernorm=True, kv_channels=16)
    with single_process_megatron():
        block = spec.get_layer_spec(types.SimpleNamespace(num_experts=None, qk_layernorm=True), config, None)
        assert len(block.layer_specs) == 2 and block.layer_norm is spec.HostNorm
        model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=128, max_sequence_length=32)
    attention = model.decoder.layers[1].self_attention
    for norm in (model.decoder.final_layernorm, attention.q_layernorm, attention.k_layernorm):
        assert isinstance(norm, spec.HostNorm) and norm.weight.sequence_parallel is True
    assert attention.linear_qkv.layer_norm_weight.sequence_parallel is True
    assert model.decoder.final_layernorm.weight.shape == (64,) and attention.q_layernorm.weight.shape == (16,)

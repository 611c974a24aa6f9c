"""slime's own GLM-5 spec (``slime_plugins.models.glm5.glm5 get_glm5_spec``) built and run on the host through the
glm5 patches (kernels, host linears, THD RoPE, index_topk), nothing of slime edited: on the tiny GLM-5, loaded
with slime's ``hf_to_megatron``, its logits are transformers' ``GlmMoeDsa`` logits, the backward reaches every
trained weight, IndexShare layers carry no indexer, and slime's ``megatron_to_hf`` gives the checkpoint back bit
for bit (item 3: slime's deepseek converters, both ways)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slime

pytest.importorskip("megatron.core")
pytest.importorskip("slime.backends.megatron_utils.hf_to_megatron", reason="real slime is not on PYTHONPATH")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import single_process_megatron  # noqa: E402
from glm5_spec_fixtures import (K, Wrap, glm5_model, glm5_patched, megatron_config, packed,  # noqa: E402
                                slime_args, thd_positions)

# fp32 on both sides, transformers' model aligned to GLM-5's checkpoint semantics (the torch engine's
# ``align_glm_moe_dsa``: the latent norms' epsilon; unaligned, transformers' 1e-6 norms gave 3.4e-5). Measured on
# an Intel Xeon (2 cores, AVX-512): 3.9e-7 on logits of magnitude 0.65.
LOGITS_ATOL = 2e-6
LENGTHS = [12, 9]  # two packed sequences: cu_seqlens and the per-sequence causal selection matter


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(slime's glm5 module, the Megatron model, transformers' model, the HF dir); index_topk 32 >= every
    sequence here, so both sides attend all causal keys and the logits can agree."""
    from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights
    from transformers import AutoModelForCausalLM

    from slime_ascend.glm5.tiny import tiny_glm5_config

    torch.manual_seed(0)
    from slime_ascend.rollout.torch_engine.glm5 import align_glm_moe_dsa

    hf = align_glm_moe_dsa(AutoModelForCausalLM.from_config(tiny_glm5_config(index_topk=32), dtype=torch.float32)).eval()
    path = tmp_path_factory.mktemp("tiny-glm5")
    hf.save_pretrained(str(path))
    with single_process_megatron(), glm5_patched() as glm5:
        model = glm5_model(glm5, slime_args(path), megatron_config())
        load_hf_weights(slime_args(path), [Wrap(Wrap(model))], str(path))
        yield glm5, model, hf, path


def _forward(model, ids):
    return model(ids, thd_positions(LENGTHS), None, packed_seq_params=packed(LENGTHS))


def test_the_spec_is_slimes_with_host_parts_and_index_share_layers_drop_the_indexer(built):
    glm5, model, _, _ = built
    from slime_ascend.cpu.glm5_spec import HostDuplicatedLinear

    layers = model.decoder.layers
    assert all(type(layer.self_attention) is glm5.DSAMLASelfAttention for layer in layers)
    assert [layer.self_attention.skip_topk for layer in layers] == [False, True, False, True]  # indexer_types
    assert [layer.self_attention.index_topk for layer in layers] == [32] * 4  # the checkpoint's, not 2048
    names = {n for n, _ in model.named_parameters()}
    for i in (0, 2):
        assert {f"decoder.layers.{i}.self_attention.{p}" for p in ("wq_b.weight", "wk.weight", "k_norm.weight",
                                                                   "k_norm.bias", "weights_proj.weight")} <= names
    assert not [n for n in names if n.startswith(("decoder.layers.1.self_attention.w", "decoder.layers.3.self_attention.w"))]
    assert isinstance(layers[0].self_attention.linear_q_down_proj, HostDuplicatedLinear)
    assert {"decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.layers.1.pre_mlp_layernorm.weight",
            "decoder.layers.1.mlp.experts.linear_fc1.weight3", "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
            "decoder.layers.0.input_layernorm.weight"} <= names
    # the stand-ins are what slime's wrappers call
    assert sys.modules["slime_plugins.models.glm5.ops.indexer"].indexer_fwd_interface.__module__ == \
        "slime_ascend.glm5.ops.indexer"


def test_logits_are_transformers_and_the_backward_reaches_every_trained_weight(built):
    _, model, hf, _ = built
    torch.manual_seed(1)
    ids = torch.randint(3, K["vocab_size"], (1, sum(LENGTHS)))
    out = _forward(model, ids)
    with torch.no_grad():
        expected = torch.cat([hf(input_ids=part).logits for part in ids.split(LENGTHS, dim=1)], dim=1)
    print(f"max |logits gap| {(out.detach() - expected).abs().max().item():.2e}")
    torch.testing.assert_close(out.detach(), expected, rtol=0, atol=LOGITS_ATOL)
    model.zero_grad(set_to_none=True)
    torch.log_softmax(out, -1)[0, :-1].gather(-1, ids[0, 1:, None]).sum().backward()
    without = sorted(n for n, p in model.named_parameters() if p.grad is None or not torch.any(p.grad != 0))
    # slime's GLM-5 spec has no indexer loss (glm5.py discards the indexer scores): only the indexer is untrained
    assert without and all(n.split(".")[-2] in ("wq_b", "wk", "k_norm", "weights_proj") for n in without), without
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_a_top_k_smaller_than_the_sequence_selects_that_many_keys(built):
    """index_topk 4 < 12: the sparse MLA attends 4 keys per query; the forward still runs and differs."""
    _, model, _, _ = built
    torch.manual_seed(1)
    ids = torch.randint(3, K["vocab_size"], (1, sum(LENGTHS)))
    seen = []
    attn0 = model.decoder.layers[0].self_attention
    import slime_plugins.models.glm5.ops.sparse_mla as sparse_mla

    original = sparse_mla.sparse_mla_fwd_interface

    def spy(q, kv, indices, **kw):
        seen.append(indices.clone())
        return original(q, kv, indices, **kw)

    with torch.no_grad():
        dense = _forward(model, ids)
        for layer in model.decoder.layers:
            layer.self_attention.index_topk = 4
        sparse_mla.sparse_mla_fwd_interface = spy
        try:
            sparse = _forward(model, ids)
        finally:
            sparse_mla.sparse_mla_fwd_interface = original
            for layer in model.decoder.layers:
                layer.self_attention.index_topk = 32
    assert len(seen) == 4 and all(s.shape == (sum(LENGTHS), 1, 4) for s in seen)
    assert attn0.index_topk == 32
    valid = (seen[0] >= 0).sum(-1).flatten()
    assert valid.max() == 4 and valid[LENGTHS[0]] == 1  # a sequence's first query has one key, its own
    assert torch.equal(seen[1], seen[0]) and torch.equal(seen[3], seen[2])  # IndexShare: layers 2, 4 reuse
    assert (sparse - dense).abs().max() > 10 * LOGITS_ATOL


def test_slimes_converters_round_trip_the_checkpoint_bit_for_bit(built):
    from safetensors.torch import load_file
    from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf
    from slime.backends.megatron_utils.update_weight.common import named_params_and_buffers

    _, model, _, path = built
    checkpoint = load_file(str(path / "model.safetensors"))
    args = slime_args(path)
    pushed = {}
    for name, param in named_params_and_buffers(args, [Wrap(Wrap(model))]):
        for hf_name, tensor in convert_to_hf(args, "glmmoedsaconfig", name, param.detach()):
            assert hf_name not in pushed, hf_name
            pushed[hf_name] = tensor
    assert sorted(pushed) == sorted(checkpoint)
    for name, tensor in checkpoint.items():
        assert torch.equal(pushed[name], tensor), name

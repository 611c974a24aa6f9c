"""The qat plugin's train-side fake quant on Megatron-named weights of one Qwen3 layer (one process, no TP).

The statement checked: what the hooked module computes with is, bit for bit, the exporter's weights, i.e. slime's
converter applied to the fake-quantised Megatron weight gives ``dequantize(quantize(...))`` of slime's converter
applied to the master weight, for int4-group and fp8-block (where Megatron's interleaved q/k/v rows make a
fake quant of the Megatron weight as one matrix differ: the rows test's teeth); the weights the exporter keeps
(embedding, norms, lm_head) are not hooked; the backward is straight-through; the parameter is back after the
forward."""

from __future__ import annotations

import types

import pytest
import torch

from conftest import need

pytestmark = pytest.mark.slime
need("slime.backends.megatron_utils.megatron_to_hf")

from slime_ascend.qat import modules  # noqa: E402
from slime_ascend.quant.fake_quant import fake_quantize_values  # noqa: E402
from slime_ascend.quant.params import dequantize_named_params, quantize_named_params  # noqa: E402
from slime_ascend.quant.schemes import make_spec  # noqa: E402

# tiny Qwen3: hidden 64, 4 heads / 2 query groups of 16, ffn 96
ARGS = types.SimpleNamespace(hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, q_lora_rank=None,
                             vocab_size=128)
P = "module.module.decoder.layers.0."
SHAPES = {
    "module.module.embedding.word_embeddings.weight": (128, 64),
    P + "self_attention.linear_qkv.layer_norm_weight": (64,),
    P + "self_attention.linear_qkv.weight": ((4 + 2 + 2) * 16, 64),
    P + "self_attention.linear_proj.weight": (64, 64),
    P + "self_attention.q_layernorm.weight": (16,),
    P + "mlp.linear_fc1.layer_norm_weight": (64,),
    P + "mlp.linear_fc1.weight": (2 * 96, 64),
    P + "mlp.linear_fc2.weight": (64, 96),
    "module.module.decoder.final_layernorm.weight": (64,),
    "module.module.output_layer.weight": (128, 64),
}
QUANTISED = {P + s for s in ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                             "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")}


class Holder(torch.nn.Module):
    """One Megatron parameter in a module whose forward reads it (a stand-in for a Megatron linear / norm)."""

    def __init__(self, shape):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(shape) * 0.1)

    def forward(self, x):
        return x @ self.weight.t() if self.weight.dim() == 2 else x * self.weight


def _model():
    torch.manual_seed(0)
    holders = {name: Holder(shape) for name, shape in SHAPES.items()}
    chunk = torch.nn.ModuleList(holders.values())
    return chunk, holders


SPECS = {"int4-group": make_spec("int4-group", group_size=32), "fp8-block": make_spec("fp8-block", block_size=(32, 32))}


@pytest.mark.parametrize("fmt", sorted(SPECS))
def test_the_hooked_weights_are_the_exporters_weights(fmt):
    spec = SPECS[fmt]
    chunk, holders = _model()
    named = [(n, h.weight) for n, h in holders.items()]
    hooks = modules.install(ARGS, [chunk], spec, "qwen3", named)
    planned = {e.name for h in hooks for e in h.plan.values()}
    assert planned == QUANTISED
    seen = {}
    for name, holder in holders.items():
        capture = holder.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, m.weight.detach()),
                                               prepend=True)  # runs before ours puts the parameter back
        param = holder.weight
        holder(torch.ones(1, holder.weight.shape[-1]) if holder.weight.dim() == 2 else torch.ones(holder.weight.shape))
        capture.remove()
        assert holder.weight is param and isinstance(holder.weight, torch.nn.Parameter), name
    for name in SHAPES:
        master = modules.hf_tensors(ARGS, "qwen3", name, holders[name].weight.detach())
        used = dict(modules.hf_tensors(ARGS, "qwen3", name, seen[name]))
        exported = dequantize_named_params(dict(quantize_named_params(master, spec)), spec, torch.float32)
        for hf_name, tensor in master:
            if name in QUANTISED:
                assert not torch.equal(exported[hf_name], tensor), hf_name  # it is quantised ...
            assert torch.equal(used[hf_name], exported[hf_name]), (fmt, hf_name)  # ... exactly as exported
    qkv = holders[P + "self_attention.linear_qkv.weight"].weight.detach()
    whole = dict(modules.hf_tensors(ARGS, "qwen3", P + "self_attention.linear_qkv.weight",
                                    fake_quantize_values(qkv, spec)))
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    # int4 groups are per row: the Megatron weight as one matrix is right; fp8 blocks are not (k rows interleave)
    assert torch.equal(whole[k_proj], dict(modules.hf_tensors(ARGS, "qwen3", P + "self_attention.linear_qkv.weight",
                                                              seen[P + "self_attention.linear_qkv.weight"]))[k_proj]) \
        == (fmt == "int4-group")
    for h in hooks:
        h.remove()


def test_the_backward_is_straight_through_to_the_master_weight():
    spec = SPECS["int4-group"]
    chunk, holders = _model()
    name = P + "mlp.linear_fc2.weight"
    modules.install(ARGS, [chunk], spec, "qwen3", [(name, holders[name].weight)])
    holder = holders[name]
    x = torch.randn(3, 96)
    holder(x).square().sum().backward()
    fq = fake_quantize_values(holder.weight.detach(), spec).requires_grad_()
    (x @ fq.t()).square().sum().backward()
    assert torch.equal(holder.weight.grad, fq.grad)  # dL/dW = dL/dFQ(W): the gradient at the quantised weight
    with torch.no_grad():
        assert torch.equal(holder(x), x @ fq.t())
    assert modules.install(ARGS, [chunk], spec, "qwen3", [(name, holders[name].weight)]) is not None
    assert len(holder._forward_pre_hooks) == 1  # a second install of the same chunk adds nothing


def test_a_weight_the_policy_splits_is_refused():
    from slime_ascend.plugins.settings import SettingsError

    spec = make_spec("int4-group", group_size=32, ignore=("model.layers.0.self_attn.k_proj",))
    chunk, holders = _model()
    name = P + "self_attention.linear_qkv.weight"
    with pytest.raises(SettingsError, match="one fake quant cannot cover both"):
        modules.plan_weights(ARGS, [chunk], spec, "qwen3", [(name, holders[name].weight)])
    whole = make_spec("int4-group", group_size=32, ignore=("model.layers.0.self_attn",))
    assert modules.plan_weights(ARGS, [chunk], whole, "qwen3", [(name, holders[name].weight)]) == {}


def test_a_shard_that_cuts_a_group_is_refused_at_install():
    from slime_ascend.plugins.settings import SettingsError

    chunk, holders = _model()
    name = P + "mlp.linear_fc2.weight"
    with pytest.raises(SettingsError, match="input dim 96 is not a multiple of the group size 64"):
        modules.plan_weights(ARGS, [chunk], make_spec("int4-group", group_size=64), "qwen3",
                             [(name, holders[name].weight)])

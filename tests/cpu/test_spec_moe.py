"""slime_ascend.cpu.spec on an MoE model: the tiny Qwen3-MoE built by the spec on a real Megatron GPTModel,
loaded with slime's own ``hf_to_megatron`` loader, must give transformers' logits (an independent
implementation of the same checkpoint), and slime's own ``megatron_to_hf`` converter must give back every
tensor of the checkpoint bit for bit."""

import types

import pytest
import torch

pytestmark = pytest.mark.slime

pytest.importorskip("megatron.core")
pytest.importorskip("slime.backends.megatron_utils.hf_to_megatron", reason="real slime is not on PYTHONPATH")

from conftest import single_process_megatron  # noqa: E402
from slime_ascend.cpu import spec  # noqa: E402
from slime_ascend.rollout.torch_engine.model import TINY_QWEN3_MOE_KWARGS, load_model, save_model  # noqa: E402

K = TINY_QWEN3_MOE_KWARGS
LOGITS_ATOL = 1e-6  # fp32, two implementations: the matmuls summed in another order (measured: 6e-8)


def _args():
    """What slime's loader and converter read of its args for this model (its flags: slime_job.TINY_QWEN3_MOE_ARGS)."""
    return types.SimpleNamespace(
        num_experts=K["num_experts"], vocab_size=K["vocab_size"], padded_vocab_size=K["vocab_size"],
        hidden_size=K["hidden_size"], num_attention_heads=K["num_attention_heads"],
        num_query_groups=K["num_key_value_heads"], kv_channels=K["head_dim"], q_lora_rank=None, qk_layernorm=True,
        normalization="RMSNorm")


def _config():
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=K["num_hidden_layers"], hidden_size=K["hidden_size"], num_attention_heads=K["num_attention_heads"],
        num_query_groups=K["num_key_value_heads"], kv_channels=K["head_dim"], ffn_hidden_size=K["intermediate_size"],
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=K["num_experts"], moe_router_topk=K["num_experts_per_tok"],
        moe_ffn_hidden_size=K["moe_intermediate_size"], moe_layer_freq=[0, 1], moe_router_score_function="softmax",
        moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32", moe_aux_loss_coeff=0.0,
        use_cpu_initialization=True, bias_activation_fusion=False, apply_rope_fusion=False, bf16=False)


class _Wrap(torch.nn.Module):  # slime's names come from DDP(Float16Module(model)): "module.module."
    def __init__(self, module):
        super().__init__()
        self.module = module
        self.config = module.config


@pytest.fixture(autouse=True)
def host_torch():
    """The cpu plugin's torch patches (train.cpu_*), as in every train actor: Megatron's all-to-all dispatcher
    makes a torch.cuda.Stream."""
    import importlib

    from slime_ascend.cpu.plugin import TORCH_PATCHES

    patches = [importlib.import_module(f"slime_ascend.patch.train.{pid.split('.', 1)[1]}").PATCH for pid in TORCH_PATCHES]
    for patch in patches:
        if not patch.applied:
            patch.install()
    yield
    for patch in patches:
        patch.remove()


@pytest.fixture
def hf_dir(tmp_path):
    model = load_model(None, moe=True, seed=3)  # fp32, saved as fp32: the round trip can be exact
    return model, save_model(model, tmp_path / "tiny-qwen3-moe")


def _megatron_model(config):
    from megatron.core.models.gpt import GPTModel

    block = spec.get_layer_spec(_args(), config, None)
    return GPTModel(config=config, transformer_layer_spec=block, vocab_size=K["vocab_size"], max_sequence_length=64,
                    position_embedding_type="rope", rotary_base=10000, share_embeddings_and_output_weights=False)


def test_moe_spec_names_are_te_grouped_names_with_a_dense_first_layer():
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    with single_process_megatron():
        model = _megatron_model(_config())
    names = {n for n, _ in model.named_parameters()}
    # layer 0 dense: the norms inside the linears, as for a dense model
    assert {"decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.layers.0.mlp.linear_fc1.weight",
            "decoder.layers.0.mlp.linear_fc2.weight"} <= names
    # layer 1 MoE: router, pre-MLP norm, one weight per expert under TE's grouped-GEMM names
    experts = {f"decoder.layers.1.mlp.experts.linear_fc{j}.weight{i}" for j in (1, 2) for i in range(4)}
    assert experts | {"decoder.layers.1.mlp.router.weight", "decoder.layers.1.pre_mlp_layernorm.weight",
                      "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"} <= names
    assert not [n for n in names if "local_experts" in n or n.startswith("decoder.layers.0.pre_mlp")]
    assert not [n for n in names if n.startswith("decoder.layers.1.mlp.linear_fc")]
    layer1 = model.decoder.layers[1]
    assert isinstance(layer1.mlp, MoELayer) and isinstance(layer1.mlp.experts, TEGroupedMLP)
    fc1 = layer1.mlp.experts.linear_fc1
    assert fc1.weight0.shape == (2 * K["moe_intermediate_size"], K["hidden_size"])
    assert layer1.mlp.experts.linear_fc2.weight3.shape == (K["hidden_size"], K["moe_intermediate_size"])
    # Megatron's DDP reduces a parameter over the expert data-parallel group when allreduce is False
    assert fc1.weight0.allreduce is False and layer1.mlp.router.weight.__dict__.get("allreduce", True) is True
    assert (fc1.weight0.partition_dim, layer1.mlp.experts.linear_fc2.weight0.partition_dim) == (0, 1)


def test_slime_loads_the_hf_checkpoint_and_the_logits_are_transformers_logits(hf_dir):
    from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights

    hf_model, path = hf_dir
    ids = torch.tensor([[5, 17, 300, 2, 99, 1000, 44, 7, 7, 512, 3, 80]])
    with single_process_megatron():
        model = _megatron_model(_config())
        load_hf_weights(_args(), [_Wrap(_Wrap(model))], path)
        model.eval()
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        with torch.no_grad():
            got = model(ids, positions, None)
            # the comparison sees the experts: exchanging two experts' down projections moves the logits
            fc2 = model.decoder.layers[1].mlp.experts.linear_fc2
            first = fc2.weight0.clone()
            fc2.weight0.copy_(fc2.weight1)
            fc2.weight1.copy_(first)
            swapped = model(ids, positions, None)
    with torch.no_grad():
        expected = hf_model(input_ids=ids).logits
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=LOGITS_ATOL)
    assert (swapped - expected).abs().max() > 1000 * LOGITS_ATOL


def test_megatron_to_hf_gives_back_the_checkpoint_bit_for_bit(hf_dir):
    from safetensors.torch import load_file
    from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights
    from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf
    from slime.backends.megatron_utils.update_weight.common import named_params_and_buffers

    _, path = hf_dir
    checkpoint = load_file(str(path / "model.safetensors"))
    with single_process_megatron():
        wrapped = [_Wrap(_Wrap(_megatron_model(_config())))]
        load_hf_weights(_args(), wrapped, path)
        pushed = {}
        for name, param in named_params_and_buffers(_args(), wrapped):
            for hf_name, tensor in convert_to_hf(_args(), "qwen3moeconfig", name, param.detach()):
                assert hf_name not in pushed, hf_name
                pushed[hf_name] = tensor
    assert sorted(pushed) == sorted(checkpoint)
    assert len([n for n in pushed if ".mlp.experts." in n]) == 3 * K["num_experts"]
    for name, tensor in checkpoint.items():
        assert torch.equal(pushed[name], tensor), name


def test_megatron_distributed_checkpoint_of_the_experts_round_trips(hf_dir, tmp_path):
    """slime's ``--save``: Megatron's dist checkpoint of the model, its experts under TE's grouped layout."""
    from megatron.core import dist_checkpointing
    from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights

    _, path = hf_dir
    (tmp_path / "ckpt").mkdir()
    with single_process_megatron():
        model = _megatron_model(_config())
        load_hf_weights(_args(), [_Wrap(_Wrap(model))], path)
        sharded = model.sharded_state_dict()
        assert {"decoder.layers.1.mlp.experts.experts.linear_fc1.weight",
                "decoder.layers.1.mlp.experts.experts.linear_fc2.weight"} <= {t.key for t in sharded.values()
                                                                               if hasattr(t, "key")}
        dist_checkpointing.save(sharded, str(tmp_path / "ckpt"))
        other = _megatron_model(_config())  # its own random weights
        other.load_state_dict(dist_checkpointing.load(other.sharded_state_dict(), str(tmp_path / "ckpt")))
    mine, theirs = dict(model.named_parameters()), dict(other.named_parameters())
    assert sorted(mine) == sorted(theirs)
    for name, tensor in mine.items():
        assert torch.equal(theirs[name], tensor), name

"""One tensor-parallel run of slime_ascend.cpu.spec, for tests/cpu/test_spec_tensor_parallel.py.

``run`` is one of TP gloo processes (the test forks them with ``zygote.spawn``, under the cpu plugin) that
each build the tiny Qwen3 as slime's model provider does (the cpu spec, vocab-parallel output), load MODEL_DIR
with slime's own ``load_hf_weights``, run the packed batch of ``BATCH`` forward and backward through Megatron's
DDP, slime's vocab-parallel log-probs and Megatron's ``finalize_model_grads`` (the TP all-reduce of the norms'
gradients under sequence parallelism and of the q/k norms'), and write ``OUT.{rank}.pt``: the log-probs, each
local gradient, and the expected local gradient: GRADS_DIR (transformers' gradients of the same loss, saved as
an HF checkpoint) loaded by the same ``load_hf_weights`` into a second model, i.e. converted and sharded exactly
as the weights were.
"""

from __future__ import annotations

import types

import torch

# three packed sequences, as slime packs a micro-batch (THD), then padding to a multiple of TP x 128; the
# last one crosses the middle of the 256 tokens, so under sequence parallelism both ranks hold real tokens
BATCH = ([5, 17, 300, 2, 999, 41, 7, 7, 64, 512, 3, 88, 1000],
         [9, 8, 7, 6, 5, 4, 3, 2, 1023],
         [(37 * i + 11) % 1024 for i in range(130)])


def tiny_model():
    """The tiny Qwen3 in fp32 with every weight drawn at a scale that makes the logits and gradients large (norm
    weights around 1, not all 1: a norm applied on the wrong shard shows)."""
    from transformers import AutoModelForCausalLM

    from slime_ascend.rollout.torch_engine.model import tiny_qwen3_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in name else 0.15 * torch.randn_like(param))
    return model


def batch_log_probs(model) -> torch.Tensor:
    """transformers' log-probs of each BATCH sequence's next tokens, concatenated (with autograd)."""
    log_probs = []
    for tokens in BATCH:
        ids = torch.tensor(tokens)[None]
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        log_probs.append(logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1))
    return torch.cat(log_probs)


def _config(tp: int, sp: bool):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    # slime_ascend.demo.slime_job.TINY_QWEN3_ARGS, in fp32
    return TransformerConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, qk_layernorm=True, tensor_model_parallel_size=tp, sequence_parallel=sp,
        use_cpu_initialization=True, attention_softmax_in_fp32=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        params_dtype=torch.float32)


def _model(config, args):
    from megatron.core.models.gpt import GPTModel

    from slime_ascend.cpu import spec

    return GPTModel(config=config, transformer_layer_spec=spec.get_layer_spec(args, config, None), vocab_size=1024,
                    max_sequence_length=4096, position_embedding_type="rope", rotary_base=10000,
                    share_embeddings_and_output_weights=False, parallel_output=True)


def _batch(tp: int):
    import torch.nn.functional as F
    from megatron.core.packed_seq_params import PackedSeqParams

    tokens = [torch.tensor(t) for t in BATCH]
    lengths = [len(t) for t in BATCH]
    real = sum(lengths)
    pad = -real % (tp * 128)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist(), real + pad], dtype=torch.int)
    longest = int((cu[1:] - cu[:-1]).max())
    params = PackedSeqParams(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest,
                             qkv_format="thd")
    flat = F.pad(torch.cat(tokens), (0, pad))
    # each position predicts the next token of its own sequence; a sequence's last position predicts nothing
    target = torch.cat([F.pad(t[1:], (0, 1)) for t in tokens])
    keep = torch.cat([torch.arange(n) < n - 1 for n in lengths])
    return flat, params, target, keep, real


def run(rank: int, world: int, port: int, model_dir: str, grads_dir: str, sp: bool, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights
    from slime.utils.ppo_utils import calculate_log_probs_and_entropy

    mpu.initialize_model_parallel(world, 1)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)  # as slime's --inference-rng-tracker
    config = _config(world, sp)
    args = types.SimpleNamespace(num_experts=None, qk_layernorm=True, padded_vocab_size=1024)
    model = _model(config, args)
    load_hf_weights(args, [model], model_dir)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    flat, params, target, keep, real = _batch(world)
    logits = ddp(input_ids=flat[None], position_ids=None, attention_mask=None, labels=None,
                 packed_seq_params=params)
    log_probs, _ = calculate_log_probs_and_entropy(logits.squeeze(0)[:real].float().contiguous(), target,
                                                   mpu.get_tensor_model_parallel_group())
    log_probs = log_probs.squeeze(-1)
    (-(log_probs * keep).sum()).backward()
    finalize_model_grads([ddp])

    expected = _model(config, args)
    load_hf_weights(args, [expected], grads_dir)
    wanted = dict(expected.named_parameters())
    torch.save({
        "log_probs": log_probs[keep].detach(),
        "grads": {name: p.main_grad.detach().clone() for name, p in model.named_parameters()},
        "expected": {name: wanted[name].detach().clone() for name, _ in model.named_parameters()},
    }, f"{out}.{rank}.pt")
    dist.destroy_process_group()

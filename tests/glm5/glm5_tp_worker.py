"""One run of slime's own GLM-5 spec at a tensor-parallel size, for tests/glm5/test_glm5_tensor_parallel.py.

``run`` is one of TP gloo processes (the test forks them with ``zygote.spawn``, under the cpu plugin) that each
build the tiny GLM-5 with slime's ``get_glm5_spec`` under the cpu plugin's torch patches and the glm5 patches (as
the cpu plugin installs them in a train actor), load MODEL_DIR with slime's ``load_hf_weights``, run the packed
batch of ``BATCH`` forward and backward through Megatron's DDP, slime's vocab-parallel log-probs and Megatron's
``finalize_model_grads``, and write ``OUT.{rank}.pt``: the log-probs, and every gradient as the HF tensor slime's
weight push would make of it (the gradients copied into the parameters, then slime's own ``all_gather_param`` and
``convert_to_hf``: TP shards gathered, names and layouts the checkpoint's), so runs at different TP sizes compare
name by name. Expert TP 1 and EP 1, as the cpu plugin runs MoE (the experts replicated over expert data parallelism
TP).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# three packed sequences longer than the tiny GLM-5's index_topk (8), then padding to a multiple of TP x 64; the
# last one crosses the middle of the 128 tokens, so under sequence parallelism both ranks hold real tokens
BATCH = ([5, 17, 300, 2, 999, 41, 7, 7, 64, 512, 3, 88, 1000, 77, 12, 19, 640, 3, 3, 900],
         [9, 8, 7, 6, 5, 4, 3, 2, 1023, 15, 700, 44],
         [(37 * i + 11) % 1024 for i in range(70)])
PAD_TO = 64


def _config(tp: int, sp: bool):
    from glm5_spec_fixtures import megatron_config

    config = megatron_config()
    config.tensor_model_parallel_size = tp
    config.expert_tensor_parallel_size = 1
    config.sequence_parallel = sp
    config.params_dtype = torch.float32
    config.attention_softmax_in_fp32 = True
    config.gradient_accumulation_fusion = False
    config.masked_softmax_fusion = False
    config.bias_dropout_fusion = False
    config.persist_layer_norm = False
    return config


def _batch(tp: int):
    import torch.nn.functional as F
    from megatron.core.packed_seq_params import PackedSeqParams

    tokens = [torch.tensor(t) for t in BATCH]
    lengths = [len(t) for t in BATCH]
    real = sum(lengths)
    pad = -real % (tp * PAD_TO)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist(), real + pad], dtype=torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    params = PackedSeqParams(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                             max_seqlen_q=longest, max_seqlen_kv=longest, qkv_format="thd")
    flat = F.pad(torch.cat(tokens), (0, pad))
    positions = torch.cat([torch.arange(n) for n in [*lengths, pad]])
    # each position predicts the next token of its own sequence; a sequence's last position predicts nothing
    target = torch.cat([F.pad(t[1:], (0, 1)) for t in tokens])
    keep = torch.cat([torch.arange(n) < n - 1 for n in lengths])
    return flat, positions, params, target, keep, real


def run(rank: int, world: int, port: int, model_dir: str, sp: bool, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    mpu.initialize_model_parallel(world, 1, expert_tensor_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)  # --inference-rng-tracker
    from glm5_spec_fixtures import Wrap, glm5_model, glm5_patched, slime_args

    with glm5_patched() as glm5:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights
        from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf
        from slime.backends.megatron_utils.update_weight.common import all_gather_param, named_params_and_buffers
        from slime.utils.ppo_utils import calculate_log_probs_and_entropy

        config = _config(world, sp)
        args = slime_args(model_dir)
        model = glm5_model(glm5, args, config)
        for param in model.parameters():  # what Megatron's get_model does for slime's model
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        load_hf_weights(args, [Wrap(Wrap(model))], model_dir)
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        flat, positions, params, target, keep, real = _batch(world)
        logits = ddp(flat[None], positions[None], None, packed_seq_params=params)
        log_probs, _ = calculate_log_probs_and_entropy(logits.squeeze(0)[:real].float().contiguous(), target,
                                                       mpu.get_tensor_model_parallel_group())
        log_probs = log_probs.squeeze(-1)
        (-(log_probs * keep).sum()).backward()
        finalize_model_grads([ddp])
        untrained = sorted(n for n, p in model.named_parameters() if not torch.any(p.main_grad != 0))
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.main_grad)
        grads = {}
        for name, param in named_params_and_buffers(args, [Wrap(Wrap(model))]):
            if "expert_bias" in name:
                continue
            for hf_name, tensor in convert_to_hf(args, "glmmoedsaconfig", name, all_gather_param(name, param)):
                grads[hf_name] = tensor.detach().clone()
    torch.save({"log_probs": log_probs[keep].detach(), "grads": grads, "untrained": untrained}, f"{out}.{rank}.pt")
    dist.destroy_process_group()

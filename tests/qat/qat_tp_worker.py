"""One tensor-parallel QAT run of the tiny Qwen3, for tests/qat/test_qat_tensor_parallel.py.

``run`` is one of TP gloo processes (the test forks them with ``zygote.spawn``, under the cpu plugin) that each
build the tiny Qwen3 as slime's model provider does (``tests/cpu/spec_tp_worker.py``'s model: the cpu spec,
vocab-parallel output), load MODEL_DIR with slime's ``load_hf_weights``, wrap it in Megatron's DDP, install the qat
hooks (int4-group, GROUP) as the plugin does, and write ``OUT.{rank}.pt``:

* ``exporter``: per hooked weight, whether the TP-gathered fake quant this rank's hook computes (gathered by slime's
  own ``all_gather_param``) converted to HF is, bit for bit, ``dequantize(quantize(...))`` of the gathered master
  weight converted to HF (what ``slime-ascend quantize`` / ``int4-sync`` produce), and whether it differs from it;
* ``log_probs`` of the packed batch under the hooks (forward and backward through DDP), ``plain_log_probs`` without
  them, and ``baked_log_probs`` / ``baked_grads`` of a second model whose parameters hold the fake-quantised
  values (no hooks): the straight-through gradient is the gradient at the quantised weights;
* ``grads``: the hooked model's ``main_grad`` per parameter.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from spec_tp_worker import _batch, _config, _model  # noqa: E402


def _gathered(name, param, tensor):
    """``tensor`` (a value of ``param``'s shard) gathered over TP as slime gathers ``param``."""
    from slime.backends.megatron_utils.update_weight.common import all_gather_param

    carrier = torch.nn.Parameter(tensor.detach().clone(), requires_grad=False)
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "parallel_mode"):
        if hasattr(param, attr):
            setattr(carrier, attr, getattr(param, attr))
    return all_gather_param(name, carrier)


def _log_probs(ddp, tp, backward: bool):
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import finalize_model_grads
    from slime.utils.ppo_utils import calculate_log_probs_and_entropy

    flat, params, target, keep, real = _batch(tp)
    ddp.zero_grad_buffer()
    with torch.set_grad_enabled(backward):
        logits = ddp(input_ids=flat[None], position_ids=None, attention_mask=None, labels=None,
                     packed_seq_params=params)
        log_probs, _ = calculate_log_probs_and_entropy(logits.squeeze(0)[:real].float().contiguous(), target,
                                                       mpu.get_tensor_model_parallel_group())
        log_probs = log_probs.squeeze(-1)
    if backward:
        (-(log_probs * keep).sum()).backward()
        finalize_model_grads([ddp])
    return log_probs[keep].detach()


def run(rank: int, world: int, port: int, model_dir: str, group: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights

    from slime_ascend.qat import modules
    from slime_ascend.quant.params import dequantize_named_params, quantize_named_params
    from slime_ascend.quant.schemes import make_spec

    mpu.initialize_model_parallel(world, 1)
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)
    config = _config(world, False)
    # what slime's converters and named_params_and_buffers read (slime_ascend.demo.slime_job.TINY_QWEN3_ARGS)
    args = types.SimpleNamespace(num_experts=None, qk_layernorm=True, padded_vocab_size=1024, vocab_size=1024,
                                 hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                                 q_lora_rank=None)
    spec = make_spec("int4-group", group_size=group)

    def build():
        model = _model(config, args)
        load_hf_weights(args, [model], model_dir)
        return DistributedDataParallel(config, DistributedDataParallelConfig(), model)

    ddp = build()
    plain = _log_probs(ddp, world, backward=False)
    hooks = modules.install(args, [ddp], spec, "qwen3")
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    exporter = {}
    for hook in hooks:
        for attr, entry in hook.plan.items():
            param = hook.module_ref()._parameters[attr]
            fq = modules.fake_quantize_rows(param.detach(), spec, entry.rows)
            used = dict(modules.hf_tensors(args, "qwen3", entry.name, _gathered(entry.name, param, fq)))
            master = modules.hf_tensors(args, "qwen3", entry.name, _gathered(entry.name, param, param.detach()))
            exported = dequantize_named_params(dict(quantize_named_params(master, spec)), spec, torch.float32)
            exporter[entry.name] = {n: (torch.equal(used[n], exported[n]), not torch.equal(t, exported[n]))
                                    for n, t in master}
    log_probs = _log_probs(ddp, world, backward=True)
    grads = {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}

    baked = build()
    with torch.no_grad():
        for hook in hooks:
            for attr, entry in hook.plan.items():
                target = dict(baked.module.named_parameters())[names[id(hook.module_ref()._parameters[attr])]]
                target.copy_(modules.fake_quantize_rows(target.detach(), spec, entry.rows))
    baked_log_probs = _log_probs(baked, world, backward=True)
    torch.save({
        "exporter": exporter, "log_probs": log_probs, "plain_log_probs": plain, "baked_log_probs": baked_log_probs,
        "grads": grads, "baked_grads": {n: p.main_grad.detach().clone() for n, p in baked.module.named_parameters()},
        "hooked": sorted(e.name for h in hooks for e in h.plan.values()),
    }, f"{out}.{rank}.pt")
    dist.destroy_process_group()

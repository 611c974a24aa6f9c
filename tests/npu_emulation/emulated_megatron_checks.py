"""Megatron-core on the emulated device through torch_npu's ``transfer_to_npu``, in a subprocess
(test_emulated_megatron.py runs it). Megatron needs two things on Ascend that neither torch_npu nor transfer_to_npu
provide and MindSpeed's adaptor does (``torch_adaptation``): ``Tensor.type()`` read as ``torch.cuda.*`` and the RNG
tracker reading ``torch.npu.default_generators``; the first check pins that, the second installs the ``npu`` plugin's
ledger patches that mirror MindSpeed's two adaptations (``train.npu_tensor_type``, ``train.npu_cuda_rng_state``,
what the plugin installs on an Ascend host without MindSpeed) and runs a GPT training step."""

import os
import tempfile

import pytest
import torch

from torch_npu.contrib import transfer_to_npu  # noqa: F401  (importing it applies it)
import torch.distributed as dist

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
_store = tempfile.mkdtemp()
dist.init_process_group("nccl", init_method=f"file://{_store}/store", rank=0, world_size=1)

from megatron.core import parallel_state as mpu  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402

mpu.initialize_model_parallel(1, 1)


def check_without_mindspeed_megatron_stops_where_a_real_ascend_host_would():
    assert dist.get_backend() == "hccl"
    assert torch.ones(1, device="cuda").type() == "torch.npu.FloatTensor"  # what Megatron's optimizer refuses
    with pytest.raises(IndexError):  # torch.cuda.default_generators: torch's (CPU build: empty), not torch_npu's
        model_parallel_cuda_manual_seed(1)


def check_a_gpt_training_step_with_mindspeeds_adaptations_stays_on_npu():
    from slime_ascend import patch

    for patch_id in ("train.npu_tensor_type", "train.npu_cuda_rng_state"):
        patch.install(patch_id)
    assert torch.ones(1, device="cuda").type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, device="cuda").type(torch.bfloat16).dtype == torch.bfloat16  # conversions unchanged
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_parallel_cuda_manual_seed(123)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, bf16=True,
                               params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, hidden_dropout=0.1)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                   max_sequence_length=32).cuda()
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                          grad_reduce_in_fp32=True),
                                    Float16Module(config, gpt))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0,
                                                       use_distributed_optimizer=True), [model])
    tokens = torch.randint(0, 128, (2, 16), device="cuda")
    position_ids = torch.arange(16, device="cuda").unsqueeze(0).expand(2, -1)
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool, device="cuda").tril().logical_not()
    losses = []
    for _ in range(3):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens, position_ids, mask, labels=tokens).float().mean()
        loss.backward()
        model.finish_grad_sync()
        ok, grad_norm, _ = optimizer.step()
        assert ok and grad_norm > 0
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    params = list(gpt.parameters())
    assert {p.device.type for p in params} == {"npu"} and {p.main_grad.device.type for p in params} == {"npu"}
    state = [v for s in optimizer.optimizer.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"]
    assert state and {v.device.type for v in state} == {"npu"}
    assert torch.npu.max_memory_allocated() > 0

"""An ``npu`` tensor's ``type()`` string reads as its CUDA twin (MindSpeed's ``type_wrapper``), without MindSpeed.

Megatron-core's distributed optimizer (``distrib_optimizer.py``) and gradient clipping (``clip_grads.py``) accept a
parameter only when ``param.type()`` is ``torch.cuda.FloatTensor`` / ``HalfTensor`` / ``BFloat16Tensor``. On
Ascend, ``torch_npu`` reports ``torch.npu.BFloat16Tensor``, and ``transfer_to_npu`` does not change that: Megatron
raises "Unsupported parameter type" while it builds the optimizer. MindSpeed's adaptor fixes it in its
``torch_adaptation`` (Ascend/MindSpeed 0.12.1, commit 028de58c:
``mindspeed/features_manager/megatron_basic/requirements_basic.py:106-107`` registers
``mindspeed/core/megatron_basic/requirements_basic.py:45`` ``type_wrapper`` on ``torch.Tensor.type`` and
``torch.nn.parameter.Parameter.type``). This patch is that wrapper for an Ascend host without MindSpeed (the ``npu``
plugin installs it only there, see :func:`slime_ascend.accelerator.plugin.without_mindspeed`).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source

# where Megatron compares the type strings (the reason this patch exists)
MEGATRON_CHECKS = ("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer",
                   "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32")


def cuda_type_string(type_fn):
    """MindSpeed's ``type_wrapper``: a string result has ``npu`` read as ``cuda``; a conversion (``type(dtype)``)
    returns what it returned."""

    @functools.wraps(type_fn)
    def type_as_cuda(*args, **kwargs):
        result = type_fn(*args, **kwargs)
        return result.replace("npu", "cuda") if isinstance(result, str) else result

    return type_as_cuda


class NpuTensorType(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        torch_module = modules["torch"]
        problems = missing_attrs(torch_module, ["Tensor.type", "npu"])
        backend = torch_module._C._get_privateuse1_backend_name()
        if backend != "npu":
            problems.append(f"torch's PrivateUse1 backend is {backend!r}, not 'npu' (torch_npu is not loaded)")
        # the reason it exists: Megatron still compares the type strings (gone upstream: the patch is retired)
        for target in MEGATRON_CHECKS:
            module = modules[target.partition(":")[0]]
            problems += missing_source(module, ["'torch.cuda.FloatTensor'"])
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        self.wrap(modules["torch"].Tensor, "type", cuda_type_string)


PATCH = NpuTensorType(
    id="train.npu_tensor_type",
    targets=("torch:Tensor.type", *MEGATRON_CHECKS),
    why="Megatron-core's distrib_optimizer.py and clip_grads.py accept parameters only when Tensor.type() is a "
    "torch.cuda.*Tensor string; torch_npu reports torch.npu.*Tensor and transfer_to_npu leaves it so. MindSpeed's "
    "torch_adaptation wraps Tensor.type (mindspeed/features_manager/megatron_basic/requirements_basic.py:106-107, "
    "type_wrapper at mindspeed/core/megatron_basic/requirements_basic.py:45, MindSpeed 0.12.1 commit 028de58c).",
    how="Tensor.type() results that are strings read 'npu' as 'cuda' (MindSpeed's type_wrapper; Parameter inherits "
    "it); conversions unchanged. Only on an Ascend host without MindSpeed, in processes that import megatron.core.",
    upstream="patches/megatron/megatron-device-neutral-placement.md",
    checked_on=("0.3.1",),
    needs_loaded=("torch_npu",),  # it runs where torch_npu is loaded; elsewhere there is nothing to check
)

"""A host tensor's ``type()`` string reads as its CUDA twin.

Megatron-core checks ``param.type() in ("torch.cuda.FloatTensor", "torch.cuda.HalfTensor",
"torch.cuda.BFloat16Tensor")`` and raises for anything else.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ...cpu import cuda_shims
from ..base import RuntimePatch
from ._cpu_common import cuda_absent_problems

ATTRS = ("Tensor.type",)


class CPUTensorType(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        return cuda_absent_problems(modules["torch"], ATTRS)

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        self.wrap(modules["torch"].Tensor, "type", cuda_shims.cuda_type_string)


PATCH = CPUTensorType(
    id="train.cpu_tensor_type",
    targets=("torch:Tensor.type",),
    why="Megatron-core's distrib_optimizer.py and clip_grads.py accept parameters only when Tensor.type() is a "
    "torch.cuda.*Tensor string.",
    how="Tensor.type() without an argument reports torch.cuda.<Kind>Tensor for a CPU tensor; with an argument "
    "it converts as before. Only where CUDA is absent, in processes that import megatron.core.",
    upstream="patches/megatron/megatron-device-neutral-placement.md",
    checked_on=("0.3.1",),
)

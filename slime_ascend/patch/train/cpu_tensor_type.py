"""A host tensor's ``type()`` string reads as its CUDA twin.

Megatron-core checks ``param.type() in ("torch.cuda.FloatTensor", "torch.cuda.HalfTensor",
"torch.cuda.BFloat16Tensor")`` and raises for anything else.
"""

from __future__ import annotations

from ...cpu import cuda_shims
from ._cpu_common import CudaShims

PATCH = CudaShims(
    id="train.cpu_tensor_type",
    targets=("torch:Tensor.type",),
    why="Megatron-core's distrib_optimizer.py and clip_grads.py accept parameters only when Tensor.type() is a "
    "torch.cuda.*Tensor string.",
    how="Tensor.type() without an argument reports torch.cuda.<Kind>Tensor for a CPU tensor; with an argument "
    "it converts as before. Only where CUDA is absent, in processes that import megatron.core.",
    upstream="patches/megatron/megatron-device-neutral-placement.md",
    checked_on=("0.3.1",),
    wrapped={"Tensor.type": cuda_shims.cuda_type_string},
)

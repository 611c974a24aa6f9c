"""``cuda`` devices mean the host in tensor factories and ``.to()``.

Megatron-core writes ``torch.tensor(..., device="cuda")``, ``torch.empty(..., device=
torch.cuda.current_device())`` and ``x.to("cuda")`` (``optimizer/optimizer.py``, ``tensor_parallel``, the DDP
buffers). A CUDA device is ``"cuda"``, ``"cuda:N"``, ``torch.device("cuda", N)`` or a bare int; any other device
passes through untouched. Pinned host memory (``pin_memory=True``, ``Tensor.pin_memory()``) needs a CUDA driver
and buys nothing without a device.
"""

from __future__ import annotations

from ...cpu import cuda_shims
from ._cpu_common import CudaShims

WRAPPED = {**dict.fromkeys(cuda_shims.FACTORIES, cuda_shims.map_device_kwarg),
           **{f"Tensor.{n}": cuda_shims.map_device_kwarg for n in cuda_shims.TENSOR_FACTORIES},
           "Tensor.to": cuda_shims.map_to_args, "nn.Module.to": cuda_shims.map_to_args,
           "Tensor.pin_memory": cuda_shims.tensor_pin_memory}


PATCH = CudaShims(
    id="train.cpu_device_map",
    targets=tuple(f"torch:{a}" for a in WRAPPED),
    why="Megatron-core allocates with device='cuda' / device=torch.cuda.current_device() and moves with "
    ".to('cuda'); a torch without CUDA refuses both.",
    how="torch's device-taking factories, Tensor.new_*, Tensor.to and Module.to read a CUDA device as cpu "
    "(torch_npu's transfer_to_npu does the same for npu); pin_memory is plain host memory. Only where CUDA is "
    "absent.",
    upstream="patches/megatron/megatron-device-neutral-placement.md",
    checked_on=("0.3.1",),
    wrapped=WRAPPED,
)

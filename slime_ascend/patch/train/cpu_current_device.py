"""Megatron's device placement is a no-op on the host.

Megatron-core allocates on ``torch.cuda.current_device()``, moves modules with ``.cuda()``, calls
``synchronize`` / ``set_device`` / ``empty_cache`` (``tensor_parallel/layers.py``, ``training.py``, the DDP
buffers, the optimizer), saves ``torch.cuda.get_rng_state()`` in each checkpoint, and reads
``torch.cuda.random.get_rng_state()`` as activation recompute starts (``tensor_parallel/random.py``
``_get_all_rng_states``: ``--recompute-granularity full``).
"""

from __future__ import annotations

from ...cpu import cuda_shims
from ._cpu_common import CudaShims

_DEVICE = ("current_device", "set_device", "synchronize", "empty_cache", "get_rng_state", "set_rng_state")
_RNG = ("get_rng_state", "set_rng_state")
REPLACED = {**{f"cuda.{n}": getattr(cuda_shims, n) for n in _DEVICE},
            **{f"cuda.random.{n}": getattr(cuda_shims, n) for n in _RNG}}
WRAPPED = {"Tensor.cuda": cuda_shims.tensor_cuda, "nn.Module.cuda": cuda_shims.module_cuda}


PATCH = CudaShims(
    id="train.cpu_current_device",
    targets=tuple(f"torch:{a}" for a in (*REPLACED, *WRAPPED)),
    why="Megatron-core calls torch.cuda.current_device()/set_device/synchronize/empty_cache and .cuda() "
    "directly; each raises on a host without CUDA.",
    how="current_device() returns 0 (mapped to cpu by train.cpu_device_map), .cuda() on tensors and modules "
    "is the identity, get/set_rng_state (torch.cuda and torch.cuda.random: activation recompute) use the host "
    "generator, set_device/synchronize/empty_cache do nothing. Applied in processes that import "
    "megatron.core, only where torch.cuda.is_available() is False.",
    upstream="patches/megatron/megatron-device-neutral-placement.md",
    checked_on=("0.3.1",),
    replaced=REPLACED,
    wrapped=WRAPPED,
)

"""Megatron's device placement is a no-op on the host.

Megatron-core allocates on ``torch.cuda.current_device()``, moves modules with ``.cuda()``, calls
``synchronize`` / ``set_device`` / ``empty_cache`` (``tensor_parallel/layers.py``, ``training.py``, the DDP
buffers, the optimizer), saves ``torch.cuda.get_rng_state()`` in each checkpoint, and reads
``torch.cuda.random.get_rng_state()`` as activation recompute starts (``tensor_parallel/random.py``
``_get_all_rng_states``: ``--recompute-granularity full``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ...cpu import cuda_shims
from ..base import RuntimePatch
from ._cpu_common import cuda_absent_problems

ATTRS = ("cuda.current_device", "cuda.set_device", "cuda.synchronize", "cuda.empty_cache", "cuda.get_rng_state",
         "cuda.set_rng_state", "cuda.random.get_rng_state", "cuda.random.set_rng_state", "Tensor.cuda",
         "nn.Module.cuda")


class CPUCurrentDevice(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        return cuda_absent_problems(modules["torch"], ATTRS)

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        torch = modules["torch"]
        self.replace(torch.cuda, "current_device", cuda_shims.current_device)
        self.replace(torch.cuda, "set_device", cuda_shims.set_device)
        self.replace(torch.cuda, "synchronize", cuda_shims.synchronize)
        self.replace(torch.cuda, "empty_cache", cuda_shims.empty_cache)
        self.replace(torch.cuda, "get_rng_state", cuda_shims.get_rng_state)
        self.replace(torch.cuda, "set_rng_state", cuda_shims.set_rng_state)
        self.replace(torch.cuda.random, "get_rng_state", cuda_shims.get_rng_state)
        self.replace(torch.cuda.random, "set_rng_state", cuda_shims.set_rng_state)
        self.wrap(torch.Tensor, "cuda", cuda_shims.tensor_cuda)
        self.wrap(torch.nn.Module, "cuda", cuda_shims.module_cuda)


PATCH = CPUCurrentDevice(
    id="train.cpu_current_device",
    targets=tuple(f"torch:{a}" for a in ATTRS),
    why="Megatron-core calls torch.cuda.current_device()/set_device/synchronize/empty_cache and .cuda() "
    "directly; each raises on a host without CUDA.",
    how="current_device() returns 0 (mapped to cpu by train.cpu_device_map), .cuda() on tensors and modules "
    "is the identity, get/set_rng_state (torch.cuda and torch.cuda.random: activation recompute) use the host "
    "generator, set_device/synchronize/empty_cache do nothing. Applied in processes that import "
    "megatron.core, only where torch.cuda.is_available() is False.",
    upstream="patches/megatron/megatron-device-neutral-placement.md",
    checked_on=("0.3.1",),
)

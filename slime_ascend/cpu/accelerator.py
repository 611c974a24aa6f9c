"""The ``cpu`` backend for slime's accelerator registry (``slime.utils.accelerator``).

slime ships ``cuda`` and ``musa`` only, so on a host without either it stops with "No usable
accelerator". This backend runs slime's device calls on the host CPU: gloo for process groups and
weight updates, ``current_device() == "cpu"``, host memory for the memory queries, torch's
``torch.cpu`` streams and events. Like :mod:`slime_ascend.accelerator.npu`, importing this module
imports neither torch nor slime; the class is built on first use as a subclass of slime's
``TorchAccelerator``.

Priority is the lowest of all backends: a host that has CUDA, MUSA or an NPU keeps it unless
``SLIME_ACCELERATOR=cpu`` asks for this one.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger("slime_ascend.cpu")

NAME = "cpu"
PRIORITY = -100
COMMUNICATION_BACKEND = "gloo"
VISIBLE_DEVICES_ENV = "SLIME_ASCEND_CPU_VISIBLE_DEVICES"  # never read by torch; keeps CUDA_VISIBLE_DEVICES alone


@functools.lru_cache(maxsize=None)
def accelerator_class() -> type:
    import torch
    from slime.utils.accelerator.torch_accelerator import TorchAccelerator

    from . import cuda_shims

    class CPUAccelerator(TorchAccelerator):
        name = NAME
        device_type = NAME
        communication_backend_name = COMMUNICATION_BACKEND

        def _module(self) -> Any:
            return torch.cpu

        def accelerator_module(self) -> Any:
            return None  # slime's convention for CPU (base.Accelerator.accelerator_module)

        def is_available(self) -> bool:
            return True

        def device_name(self, index=None) -> str:
            if isinstance(index, torch.device):
                return str(index)
            return NAME  # one device: "cpu", never "cpu:0" (torch accepts both; slime compares strings)

        def set_device(self, index) -> None:
            return None

        def current_device(self) -> str:
            return NAME

        def device_count(self) -> int:
            return 1

        def synchronize(self, device=None) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def mem_get_info(self, device=None) -> tuple[int, int]:
            return cuda_shims.host_memory()

        def memory_allocated(self, device=None) -> int:
            return 0

        def memory_reserved(self, device=None) -> int:
            return 0

        def memory_module(self) -> Any:
            return None

        def get_device_properties(self, device=None) -> Any:
            # what Megatron's torch.cuda call gets (train.cpu_device_properties)
            return cuda_shims.get_device_properties(device)

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def get_rng_state(self, device=None):
            return torch.get_rng_state()

        def set_rng_state(self, state, device=None) -> None:
            torch.set_rng_state(state)

        def initial_seed(self) -> int:
            return int(torch.initial_seed())

        def distributed_device_id(self, index=None):
            return None  # gloo takes no device_id

        def communication_backend(self, default: str = "nccl") -> str:
            # every device transport slime asks for (nccl, hccl, mccl) is gloo here
            return COMMUNICATION_BACKEND if default in ("nccl", "hccl", "mccl", "gloo") else default

        def weight_update_backend(self, default: str = "nccl") -> str:
            return self.communication_backend(default)

        @property
        def visible_devices_env(self) -> str:
            return VISIBLE_DEVICES_ENV

        def resolve_visible_device_id(self, physical_device_id) -> int:
            return 0

        def supports(self, capability: str) -> bool:
            if capability == "requires_cpu_initialization":
                return True
            if capability == "bf16":
                return True
            if capability in {"nvml_affinity", "sglang_fp8_utils", "strict_fp32_logits", "torch_compile",
                              "triton_kernels", "cuda_int4_extension"}:
                return False
            return super().supports(capability)

        def post_import_torch(self) -> None:
            return None

    return CPUAccelerator


def make_accelerator() -> Any:
    return accelerator_class()()


def register(accelerator_module: Any) -> None:
    """Register ``cpu`` in slime's accelerator registry (``accelerator_module`` is
    ``slime.utils.accelerator``). Idempotent."""
    accelerator_module.register_accelerator(
        NAME, make_accelerator, lambda: True, priority=PRIORITY, communication_backends=(COMMUNICATION_BACKEND,)
    )
    logger.debug("registered the cpu accelerator (priority %d, %s)", PRIORITY, COMMUNICATION_BACKEND)

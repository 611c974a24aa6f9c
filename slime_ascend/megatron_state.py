"""Megatron's parallel state as our train-side adapters need it, read lazily.

Megatron absent, or torch.distributed / model parallelism not initialised, means one rank: every
lookup then answers "no group" or size 1, so the same adapter code runs in plain CPU tests and the
demo as in slime's train actors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

AllGather = Callable[[torch.Tensor], list[torch.Tensor]]


def mpu_or_none() -> Any:
    """``megatron.core.mpu`` when it is importable and initialised, else None."""
    try:
        from megatron.core import mpu
    except ImportError:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and mpu.model_parallel_is_initialized()):
        return None
    return mpu


def dp_group() -> Any:
    """The data-parallel group (without context parallelism); None with one DP rank."""
    mpu = mpu_or_none()
    if mpu is None or mpu.get_data_parallel_world_size(with_context_parallel=False) == 1:
        return None
    return mpu.get_data_parallel_group(with_context_parallel=False)


def cp_state() -> tuple[int, int, AllGather | None]:
    """(cp_rank, cp_size, all_gather over the CP group); (0, 1, None) with one CP rank."""
    mpu = mpu_or_none()
    size = 1 if mpu is None else mpu.get_context_parallel_world_size()
    if size == 1:
        return 0, 1, None
    import torch.distributed as dist

    group = mpu.get_context_parallel_group()

    def all_gather(x: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(out, x.contiguous(), group=group)
        return out

    return mpu.get_context_parallel_rank(), size, all_gather

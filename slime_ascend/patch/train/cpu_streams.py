"""Megatron's CUDA streams and events are host stand-ins.

Megatron-core builds them for overlapped gradient reduction and parameter gathering (``distributed/``,
``training.py``) and enters ``torch.cuda.stream(...)`` contexts. On the host all work is synchronous: an event
has a wall-clock ``elapsed_time``, and a stream context does nothing.
"""

from __future__ import annotations

from ...cpu import cuda_shims
from ._cpu_common import CudaShims

REPLACED = {f"cuda.{n}": getattr(cuda_shims, n)
            for n in ("Stream", "Event", "current_stream", "default_stream", "stream", "set_stream")}


PATCH = CudaShims(
    id="train.cpu_streams",
    targets=tuple(f"torch:{a}" for a in REPLACED),
    why="Megatron-core's DDP and optimizer create torch.cuda.Stream/Event objects and stream contexts, "
    "which a torch without CUDA cannot build.",
    how="torch.cuda.Stream/Event/current_stream/default_stream/stream/set_stream become synchronous host "
    "stand-ins (torch.cpu.Stream; events complete when recorded). Only where CUDA is absent.",
    upstream="patches/megatron/megatron-device-neutral-placement.md",
    checked_on=("0.3.1",),
    replaced=REPLACED,
    required=("cpu.Stream",),  # cuda_shims.Stream subclasses it
)

"""Megatron's CUDA streams and events are host stand-ins.

Megatron-core builds them for overlapped gradient reduction and parameter gathering (``distributed/``,
``training.py``) and enters ``torch.cuda.stream(...)`` contexts. On the host all work is synchronous: an event
has a wall-clock ``elapsed_time``, and a stream context does nothing.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ...cpu import cuda_shims
from ..base import RuntimePatch
from ._cpu_common import cuda_absent_problems

ATTRS = ("cuda.Stream", "cuda.Event", "cuda.current_stream", "cuda.default_stream", "cuda.stream",
         "cuda.set_stream", "cpu.Stream")


class CPUStreams(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        return cuda_absent_problems(modules["torch"], ATTRS)

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        cuda = modules["torch"].cuda
        for name in ("Stream", "Event", "current_stream", "default_stream", "stream", "set_stream"):
            self.replace(cuda, name, getattr(cuda_shims, name))


PATCH = CPUStreams(
    id="train.cpu_streams",
    targets=tuple(f"torch:{a}" for a in ATTRS[:-1]),
    why="Megatron-core's DDP and optimizer create torch.cuda.Stream/Event objects and stream contexts, "
    "which a torch without CUDA cannot build.",
    how="torch.cuda.Stream/Event/current_stream/default_stream/stream/set_stream become synchronous host "
    "stand-ins (torch.cpu.Stream; events complete when recorded). Only where CUDA is absent.",
    upstream="patches/megatron/megatron-device-neutral-placement.md",
    checked_on=("0.3.1",),
)

"""What Megatron needs from ``torch.cuda`` on a host without CUDA, in plain functions.

Megatron-core calls ``torch.cuda`` directly (about 80 ``current_device()`` calls, streams and
events in DDP and the optimizer, ``.cuda()``, ``device="cuda"`` tensors, ``Tensor.type()`` compared
with ``torch.cuda.*Tensor`` strings). On Ascend, torch_npu's ``transfer_to_npu`` redirects these to
``torch.npu``; this module is the CPU counterpart, used by the five ``train.cpu_*`` runtime patches
(each a ledger entry with its own target check). Pure torch: no slime, Ray or Megatron import.

The mapping rule: a ``cuda`` device (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda", N)``, or a bare
integer, which torch reads as the current accelerator) is the host, ``cpu``; anything else is passed
through untouched.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

CUDA = "cuda"


def is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return device.type == CUDA
    if isinstance(device, str):
        return device == CUDA or device.startswith(CUDA + ":")
    return False


def host_device(device: Any) -> Any:
    """``device`` with a CUDA device (see :func:`is_cuda_device`) replaced by ``cpu``."""
    return torch.device("cpu") if is_cuda_device(device) else device


# -- train.cpu_current_device ------------------------------------------------------------------
def current_device() -> int:
    return 0


def set_device(device: Any) -> None:
    return None


def synchronize(device: Any = None) -> None:
    return None


def empty_cache() -> None:
    return None


def get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()  # the host generator stands for the device generator


def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(new_state)


def tensor_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self  # already on the host: the identity, as .cuda() is for a tensor already there

    return cuda


def module_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def cuda(self, device=None):
        return self

    return cuda


# -- train.cpu_device_properties --------------------------------------------------------------
# Megatron reads the device architecture (megatron.training get_device_arch_version: the ``major`` of
# torch.cuda.get_device_properties("cuda:0")) only to decide whether TP/CP need CUDA_DEVICE_MAX_CONNECTIONS=1
# for overlapped communication (before Blackwell, 10) and whether FSDP/GTP groups get high-priority streams
# (from 10 on). The host has no hardware work queues and no stream priorities (train.cpu_streams' stand-ins
# are synchronous), so it reads as a device without the connection limit.
HOST_ARCH_MAJOR = 10


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory (``/proc/meminfo``; psutil where that is absent): what the cpu
    accelerator's ``mem_get_info`` answers and :func:`get_device_properties` reports as ``total_memory``."""
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
        return fields.get("MemAvailable", fields["MemFree"]), fields["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)


def get_device_properties(device: Any = None) -> Any:
    """``torch.cuda.get_device_properties`` for the host: its memory and core count, ``major`` as above."""
    import os
    import types

    return types.SimpleNamespace(name="cpu", major=HOST_ARCH_MAJOR, minor=0, total_memory=host_memory()[1],
                                 multi_processor_count=os.cpu_count() or 1)


# -- train.cpu_streams ------------------------------------------------------------------------
def current_stream(device: Any = None) -> Any:
    return torch.cpu.current_stream()


def default_stream(device: Any = None) -> Any:
    return torch.cpu.current_stream()


def stream(s: Any) -> Any:
    return contextlib.nullcontext(s)


def set_stream(s: Any) -> None:
    return None


class Event:
    """``torch.cuda.Event`` on the host: work is synchronous, so an event is complete once recorded."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 external: bool = False):
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream: Any = None) -> None:
        import time

        self._time = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event: "Event") -> float:
        if self._time is None or end_event._time is None:
            raise RuntimeError("Event.elapsed_time: both events must be recorded first")
        return (end_event._time - self._time) * 1000.0


class Stream(torch.cpu.Stream):
    """``torch.cuda.Stream(device=..., priority=...)`` on the host (torch.cpu's stand-in stream)."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any):
        return super().__new__(cls)

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any):
        super().__init__()

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> Any:
        event = event or Event()
        event.record()
        return event

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


# -- train.cpu_device_map ---------------------------------------------------------------------
# torch functions that take a ``device=`` keyword and allocate
FACTORIES = (
    "tensor", "as_tensor", "empty", "zeros", "ones", "full", "arange", "rand", "randn", "randint", "randperm",
    "linspace", "empty_strided", "empty_like", "zeros_like", "ones_like", "full_like", "rand_like",
    "randn_like", "eye", "tril_indices", "triu_indices",
)
# Tensor methods that take a ``device=`` keyword
TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")


def map_device_kwarg(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def factory(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = host_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinning is for copies to a device; it needs a CUDA driver
        return original(*args, **kwargs)

    factory.__wrapped__ = original
    return factory


def map_to_args(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.to`` / ``Module.to``: a CUDA device, positional or keyword, is the host."""

    @functools.wraps(original)
    def to(self, *args: Any, **kwargs: Any) -> Any:
        if args and is_cuda_device(args[0]) and not isinstance(args[0], bool):
            args = (torch.device("cpu"),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = host_device(kwargs["device"])
        return original(self, *args, **kwargs)

    to.__wrapped__ = original
    return to


def tensor_pin_memory(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def pin_memory(self, device: Any = None):
        return self  # nothing to pin for: the host is the device

    return pin_memory


# -- train.cpu_tensor_type --------------------------------------------------------------------
def cuda_type_string(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.type()`` (no argument) of a host tensor reads ``torch.cuda.<Kind>Tensor``, which is
    what Megatron's distributed optimizer and grad clipping compare against; with an argument it
    converts as before."""

    @functools.wraps(original)
    def type_(self, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs:
            name = original(self)
            if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch."):]
            return name
        return original(self, dtype, non_blocking, **kwargs)

    type_.__wrapped__ = original
    return type_

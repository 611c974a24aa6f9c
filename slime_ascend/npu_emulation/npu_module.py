"""TEST DOUBLE: ``torch.npu`` (``torch_npu.npu``) over the emulated device (see :mod:`slime_ascend.npu_emulation`).

This module object itself is registered as ``torch.npu`` and ``torch_npu.npu``. Names and signatures follow
torch_npu (``torch_npu/npu/__init__.py``, ``utils.py``, ``random.py``, ``memory.py``, ``streams.py``); what
slime, Megatron-core, sglang's NPU paths and this package call is implemented, with host figures:

* ``device_count()``: the ids listed in ``ASCEND_RT_VISIBLE_DEVICES`` (parsed as torch_npu parses it: digits
  and commas, up to the first other character), else ``SLIME_ASCEND_EMULATED_NPUS``, else 8 (one Atlas 800
  node); the current device is process-wide;
* memory: ``memory_allocated`` is the bytes of live ``npu`` tensors' host storages; with no caching allocator,
  ``memory_reserved`` equals it; ``mem_get_info`` and ``total_memory`` are the host's (``/proc/meminfo``);
* streams and events: work is synchronous, so a stream is always idle and an event complete once recorded;
  ``Event.elapsed_time`` is host wall time between the two records;
* random: one generator per device (``default_generators``), seeded by ``torch.manual_seed`` too.
"""

from __future__ import annotations

import contextlib
import os
import threading
import types
import warnings
from typing import Any

import torch

from ..cpu.cuda_shims import Event as _HostEvent
from ..cpu.cuda_shims import host_memory
from . import device as _device

__all__ = [
    "is_initialized", "init", "synchronize", "device_count", "can_device_access_peer", "set_device",
    "current_device", "get_device_name", "get_device_properties", "get_device_capability", "mem_get_info",
    "is_available", "device", "device_of", "StreamContext", "stream", "set_stream", "current_stream",
    "default_stream", "utilization", "manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed",
    "empty_cache", "memory_stats", "memory_stats_as_nested_dict", "reset_accumulated_memory_stats",
    "reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached", "memory_allocated",
    "max_memory_allocated", "memory_reserved", "max_memory_reserved", "memory_cached", "max_memory_cached",
    "memory_snapshot", "memory_summary", "MemPool", "use_mem_pool", "get_allocator_backend", "Stream", "Event",
    "get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all", "get_amp_supported_dtype",
    "is_autocast_enabled", "set_autocast_enabled", "get_autocast_dtype", "set_autocast_dtype", "is_bf16_supported",
    "BoolTensor", "ByteTensor", "CharTensor", "DoubleTensor", "FloatTensor", "HalfTensor", "IntTensor",
    "LongTensor", "ShortTensor", "BFloat16Tensor", "NPUGraph", "graph", "graph_pool_handle",
    "is_current_stream_capturing", "ipc_collect", "set_per_process_memory_fraction",
    "get_per_process_memory_fraction",
]

DEFAULT_DEVICE_COUNT = 8
EMULATED_COUNT_ENV = "SLIME_ASCEND_EMULATED_NPUS"
VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"
DEVICE_NAME = "Ascend910B-emulated"

default_generators: tuple = ()


def parse_visible_devices(value: str) -> list[int]:
    """``ASCEND_RT_VISIBLE_DEVICES`` as torch_npu reads it (``_parse_visible_devices``): digits and commas up
    to the first other character; an empty element ends the list."""
    end = len(value)
    for i, c in enumerate(value):
        if not (c.isdigit() or c == ","):
            end = i
            break
    ids: list[int] = []
    for element in value[:end].split(","):
        if not element:
            break
        ids.append(int(element))
    return ids


def configured_device_count(environ=os.environ) -> int:
    visible = environ.get(VISIBLE_DEVICES_ENV)
    if visible is not None:
        return len(parse_visible_devices(visible))
    value = environ.get(EMULATED_COUNT_ENV, "").strip()
    if not value:
        return DEFAULT_DEVICE_COUNT
    if not value.isdigit():
        raise ValueError(f"{EMULATED_COUNT_ENV}={value!r}: use the number of emulated NPUs, e.g. 8")
    return int(value)


# -- initialisation --------------------------------------------------------------------------------------------
def is_initialized() -> bool:
    return True


def init() -> None:
    return None


def _lazy_init() -> None:
    return None


def _lazy_call(callable_, **kwargs) -> None:
    callable_()


def _is_in_bad_fork() -> bool:
    return False


def is_available() -> bool:
    return device_count() > 0


def device_count() -> int:
    return _device.device_count()


def _get_device_index(device: Any, optional: bool = False, allow_cpu: bool = False) -> int:
    """torch_npu's rule (utils.py ``_get_device_index``): an int as is; ``npu`` without index and None: the
    current device when ``optional``; ``cpu`` gives -1 when ``allow_cpu``."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type == "cpu" and allow_cpu:
            return -1
        if device.type != _device.DEVICE_TYPE:
            raise ValueError(f"Expected a npu device, but got: {device}")
        if device.index is not None:
            return device.index
    if isinstance(device, globals()["device"]):
        return device.idx
    if device is None or (isinstance(device, torch.device) and device.index is None):
        if optional:
            return current_device()
        raise ValueError(f"Expected a npu device with a specified index or an integer, but got: {device}")
    raise ValueError(f"Expected a npu device, but got: {device!r}")


def _checked(device: Any) -> int:
    index = _get_device_index(device, optional=True)
    if index < 0 or index >= device_count():
        raise AssertionError("Invalid device id")
    return index


def set_device(device: Any) -> None:
    index = _get_device_index(device, optional=True)
    if index >= 0:
        _device.set_current_index(index)


def current_device() -> int:
    return _device.current_index()


def synchronize(device: Any = None) -> None:
    _checked(device)  # work is synchronous: nothing to wait for


def ipc_collect() -> None:
    return None


def can_device_access_peer(device_id: Any, peer_device_id: Any) -> bool:
    _checked(device_id)
    _checked(peer_device_id)
    return True


class device:
    """Context manager that changes the current device (torch_npu ``utils.device``)."""

    def __init__(self, device: Any):
        self.idx = _get_device_index(device, optional=True)
        self.prev_idx = -1

    def __enter__(self):
        if self.idx < 0:
            return
        self.prev_idx = current_device()
        if self.prev_idx != self.idx:
            set_device(self.idx)

    def __exit__(self, *args):
        if self.idx >= 0 and self.prev_idx >= 0 and self.prev_idx != self.idx:
            set_device(self.prev_idx)
        return False


class device_of(device):
    def __init__(self, obj):
        super().__init__(obj.get_device() if getattr(obj, "is_npu", False) else -1)


# -- properties ------------------------------------------------------------------------------------------------
def _host_memory() -> tuple[int, int]:
    return host_memory()


class _NPUDeviceProperties:
    """Fields of torch_npu's ``_NPUDeviceProperties`` (Module.cpp), filled with the emulation's figures."""

    def __init__(self, index: int):
        self.name = DEVICE_NAME
        self.total_memory = _host_memory()[1]
        self.cube_core_num = 0
        self.vector_core_num = 0
        self.L2_cache_size = 0
        # std::optional fields torch_npu leaves unset (Module.cpp NPUDeviceProp): None in Python
        self.major = self.minor = None
        self.is_multi_gpu_board = self.is_integrated = self.multi_processor_count = None
        self.max_threads_per_multi_processor = self.warp_size = self.regs_per_multiprocessor = None
        self.gcnArchName = None
        self.uuid = f"emulated-npu-{index}"

    def __repr__(self) -> str:
        return (f"_NPUDeviceProperties(name='{self.name}', total_memory={self.total_memory // (1024 * 1024)}MB, "
                f"cube_core_num={self.cube_core_num}, vector_core_num={self.vector_core_num}, "
                f"L2_cache_size={self.L2_cache_size // (1024 * 1024)}MB)")


def get_device_name(device_name: Any = None) -> str:
    _checked(device_name)
    return DEVICE_NAME


def get_device_properties(device_name: Any = None) -> _NPUDeviceProperties:
    return _NPUDeviceProperties(_checked(device_name))


def _capability_from_env() -> tuple[int, int] | None:
    value = os.environ.get("TORCH_NPU_DEVICE_CAPABILITY", "")
    major, dot, minor = value.partition(".")
    if dot and major.isdigit() and minor.isdigit():
        return int(major), int(minor)
    return None


def get_device_capability(device: Any = None) -> tuple[int, int] | None:
    """torch_npu: ``TORCH_NPU_DEVICE_CAPABILITY`` ("major.minor") when set, else None (with a warning)."""
    capability = _capability_from_env()
    if capability is None:
        warnings.warn("You can set the device capability via the environment variable TORCH_NPU_DEVICE_CAPABILITY. "
                      "The return value of get_device_capability is only for compatibility with PyTorch and does "
                      "not represent the actual capability of the NPU device.")
    return capability


def utilization(device: Any = None) -> int:
    _checked(device)
    return 0


def is_bf16_supported(including_emulation: bool = False) -> bool:
    return True


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes: the host's available and total memory (the emulated devices share it)."""
    _checked(device)
    return _host_memory()


# -- memory ----------------------------------------------------------------------------------------------------
def empty_cache() -> None:
    return None  # no caching allocator: host storages are freed when their last tensor dies


def memory_allocated(device: Any = None) -> int:
    return _device.memory.allocated(_checked(device))


def max_memory_allocated(device: Any = None) -> int:
    return _device.memory.max_allocated(_checked(device))


def memory_reserved(device: Any = None) -> int:
    return memory_allocated(device)


def max_memory_reserved(device: Any = None) -> int:
    return max_memory_allocated(device)


memory_cached = memory_reserved
max_memory_cached = max_memory_reserved


def reset_peak_memory_stats(device: Any = None) -> None:
    _device.memory.reset_peak(_checked(device))


def reset_max_memory_allocated(device: Any = None) -> None:
    reset_peak_memory_stats(device)


def reset_max_memory_cached(device: Any = None) -> None:
    reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device: Any = None) -> None:
    index = _checked(device)
    with _device.memory.lock:
        _device.memory.alloc_count[index] = 0
        _device.memory.free_count[index] = 0


def memory_stats(device: Any = None) -> dict[str, int]:
    index = _checked(device)
    mem = _device.memory
    current, peak = mem.allocated(index), mem.max_allocated(index)
    allocs, frees = mem.alloc_count.get(index, 0), mem.free_count.get(index, 0)
    stats = {"num_alloc_retries": 0, "num_ooms": 0, "num_sync_all_streams": 0, "num_device_alloc": allocs,
             "num_device_free": frees}
    for kind in ("allocated_bytes", "reserved_bytes", "active_bytes"):
        stats.update({f"{kind}.all.current": current, f"{kind}.all.peak": peak})
    for kind in ("allocation", "segment", "active"):
        stats.update({f"{kind}.all.current": allocs - frees, f"{kind}.all.allocated": allocs,
                      f"{kind}.all.freed": frees})
    return dict(sorted(stats.items()))


def memory_stats_as_nested_dict(device: Any = None) -> dict:
    nested: dict = {}
    for key, value in memory_stats(device).items():
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def memory_snapshot(mempool_id=None) -> list:
    return []


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    index = _checked(device)
    return (f"emulated npu:{index}: {memory_allocated(index)} bytes allocated, "
            f"peak {max_memory_allocated(index)} bytes (host memory)")


def get_allocator_backend() -> str:
    return "native"


_memory_fraction: dict[int, float] = {}


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    if not 0 <= fraction <= 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    _memory_fraction[_checked(device)] = float(fraction)


def get_per_process_memory_fraction(device: Any = None) -> float:
    return _memory_fraction.get(_checked(device), 1.0)


def _set_allocator_settings(settings: str) -> None:
    """torch_npu ``memory._set_allocator_settings``: "Only support expandable_segments:True or False"."""
    for item in str(settings).split(","):
        key, _, value = item.strip().partition(":")
        if key != "expandable_segments" or value not in ("True", "False"):
            raise RuntimeError(f"_set_allocator_settings({settings!r}): only support expandable_segments:True or "
                               "False")


class MemPool:
    """A pool id for ``use_mem_pool``; allocations made inside ``use_mem_pool(pool)`` are recorded on it (the
    emulated torch_memory_saver's regions read them)."""

    _next_id = 0
    _ids_lock = threading.Lock()

    def __init__(self, allocator: Any = None, use_on_oom: bool = False, no_split: bool = False):
        with MemPool._ids_lock:
            MemPool._next_id += 1
            self._id = (0, MemPool._next_id)
        self.allocator = allocator
        self.observers: list = []

    @property
    def id(self) -> tuple[int, int]:
        return self._id

    def use_count(self) -> int:
        return 1

    def snapshot(self) -> list:
        return []


_pool_tls = threading.local()


def current_mem_pool() -> MemPool | None:
    stack = getattr(_pool_tls, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def use_mem_pool(pool: MemPool, device: Any = None):
    """Route this thread's ``npu`` allocations to ``pool`` (torch_npu ``memory.use_mem_pool``)."""
    _checked(device)
    stack = getattr(_pool_tls, "stack", None)
    if stack is None:
        stack = _pool_tls.stack = []
    stack.append(pool)
    try:
        yield
    finally:
        stack.pop()


def _observe_allocation(storage, index: int) -> None:
    pool = current_mem_pool()
    if pool is not None:
        for observe in pool.observers:
            observe(storage, index)


# -- streams and events ------------------------------------------------------------------------------------------
class Stream:
    """An emulated NPU stream: work on the host is synchronous, so it is always complete."""

    _ids = 0
    _ids_lock = threading.Lock()

    def __init__(self, device: Any = None, priority: int = 0, stream_id: int | None = None, **kwargs: Any):
        self.device_index = _checked(device)
        self.device_type = 20  # c10 DeviceType::PrivateUse1
        self.priority = priority
        if stream_id is None:
            with Stream._ids_lock:
                Stream._ids += 1
                stream_id = Stream._ids
        self.stream_id = stream_id

    @property
    def device(self) -> torch.device:
        return torch.device(_device.DEVICE_TYPE, self.device_index)

    @property
    def npu_stream(self) -> int:
        return self.stream_id

    def wait_event(self, event: "Event") -> None:
        event.wait(self)

    def wait_stream(self, stream: "Stream") -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = Event() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def set_data_preprocess_stream(self, is_data_preprocess_stream: bool = False) -> None:
        return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and (other.stream_id, other.device_index) == (self.stream_id,
                                                                                       self.device_index)

    def __hash__(self) -> int:
        return hash((self.stream_id, self.device_index))

    def __repr__(self) -> str:
        return f"<torch_npu.npu.Stream device={self.device} npu_stream={self.stream_id:#x}>"


_default_streams: dict[int, Stream] = {}
_stream_tls = threading.local()


def default_stream(device: Any = None) -> Stream:
    index = _checked(device)
    stream_ = _default_streams.get(index)
    if stream_ is None:
        stream_ = _default_streams.setdefault(index, Stream(index, stream_id=0))
    return stream_


def current_stream(device: Any = None) -> Stream:
    index = _checked(device)
    current = getattr(_stream_tls, "current", None)
    if current is not None and index in current:
        return current[index]
    return default_stream(index)


def set_stream(stream: Stream | None) -> None:
    if stream is None:
        return
    current = getattr(_stream_tls, "current", None)
    if current is None:
        current = _stream_tls.current = {}
    current[stream.device_index] = stream


class StreamContext:
    """Context manager selecting a stream (torch_npu ``utils.StreamContext``)."""

    def __init__(self, stream_ctx: Stream | None):
        self.stream = stream_ctx
        self.src_prev_stream: Stream | None = None
        self.dst_prev_stream: Stream | None = None

    def __enter__(self):
        if self.stream is None:
            return
        self.src_prev_stream = current_stream()
        if self.src_prev_stream.device != self.stream.device:
            self.dst_prev_stream = current_stream(self.stream.device)
        set_stream(self.stream)

    def __exit__(self, *args: Any) -> None:
        if self.stream is None:
            return
        if self.dst_prev_stream is not None:
            set_stream(self.dst_prev_stream)
        set_stream(self.src_prev_stream)


def stream(stream: Stream | None) -> StreamContext:
    return StreamContext(stream)


class Event(_HostEvent):
    """An emulated NPU event: complete once recorded; ``elapsed_time`` is host time between two records (the
    ``cpu`` plugin's host event, with torch_npu's device and timing checks)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 **kwargs: Any):
        super().__init__(enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)
        self.blocking = blocking
        self.interprocess = interprocess
        self.device: torch.device | None = None

    def record(self, stream: Stream | None = None) -> None:
        stream = current_stream() if stream is None else stream
        if self.device is not None and self.device != stream.device:
            raise RuntimeError(f"Event device {self.device} does not match recording stream's device "
                               f"{stream.device}.")
        self.device = stream.device
        super().record(stream)

    def elapsed_time(self, end_event: "Event") -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._time is None or end_event._time is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return super().elapsed_time(end_event)

    def recorded_time(self) -> float:
        if self._time is None:
            raise RuntimeError("Event must be recorded before reading its time stamp.")
        return self._time * 1000.0

    def ipc_handle(self):
        raise RuntimeError("Event.ipc_handle: interprocess events are not emulated")

    def __repr__(self) -> str:
        return f"<torch_npu.npu.Event {'recorded' if self._time is not None else 'uninitialized'}>"


def is_current_stream_capturing() -> bool:
    return False


class NPUGraph:
    """Graph capture is not emulated: constructing one works, capturing raises."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def capture_begin(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("NPUGraph capture is not supported by the emulated npu device")

    def capture_end(self) -> None:
        raise RuntimeError("NPUGraph capture is not supported by the emulated npu device")

    def replay(self) -> None:
        raise RuntimeError("NPUGraph replay is not supported by the emulated npu device")


def graph(*args: Any, **kwargs: Any):
    raise RuntimeError("torch.npu.graph: graph capture is not supported by the emulated npu device")


def graph_pool_handle() -> tuple[int, int]:
    return MemPool().id


# -- random ------------------------------------------------------------------------------------------------------
def _rng_index(device: Any) -> int:
    if isinstance(device, str):
        device = torch.device(device)
    elif isinstance(device, int) and not isinstance(device, bool):
        device = torch.device(_device.DEVICE_TYPE, device)
    index = current_device() if device.index is None else device.index
    return _checked(index)


def get_rng_state(device: Any = "npu") -> torch.Tensor:
    return _device.generator(_rng_index(device)).get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "npu") -> None:
    _device.generator(_rng_index(device)).set_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


def manual_seed(seed: int) -> None:
    _device.generator(current_device()).manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for gen in _device.generators():
        gen.manual_seed(int(seed))


def seed() -> None:
    _device.generator(current_device()).seed()


def seed_all() -> None:
    gens = _device.generators()
    if gens:
        value = gens[0].seed()
        for gen in gens[1:]:
            gen.manual_seed(value)


def initial_seed() -> int:
    return _device.generator(current_device()).initial_seed()


# -- autocast ------------------------------------------------------------------------------------------------------
def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16, torch.float32]


def is_autocast_enabled() -> bool:
    return torch.is_autocast_enabled(_device.DEVICE_TYPE)


def set_autocast_enabled(enable: bool) -> None:
    torch.set_autocast_enabled(_device.DEVICE_TYPE, enable)


def get_autocast_dtype() -> torch.dtype:
    return torch.get_autocast_dtype(_device.DEVICE_TYPE)


def set_autocast_dtype(dtype: torch.dtype) -> None:
    torch.set_autocast_dtype(_device.DEVICE_TYPE, dtype)


class _autocast(torch.amp.autocast_mode.autocast):
    """``torch.npu.amp.autocast(...)`` is ``torch.autocast("npu", ...)``."""

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True):
        super().__init__(_device.DEVICE_TYPE, enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


class _GradScaler(torch.amp.GradScaler):
    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        super().__init__(_device.DEVICE_TYPE, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)


# -- legacy tensor types (``torch.npu.FloatTensor`` ...): isinstance checks and type strings --------------------------
class _LegacyTensorMeta(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, torch.Tensor) and instance.device.type == _device.DEVICE_TYPE and \
            instance.dtype == cls.dtype


def _legacy(name: str, dtype: torch.dtype) -> type:
    return _LegacyTensorMeta(name, (), {"dtype": dtype, "is_npu": True, "is_sparse": False,
                                        "__module__": "torch_npu.npu"})


BoolTensor = _legacy("BoolTensor", torch.bool)
ByteTensor = _legacy("ByteTensor", torch.uint8)
CharTensor = _legacy("CharTensor", torch.int8)
ShortTensor = _legacy("ShortTensor", torch.int16)
IntTensor = _legacy("IntTensor", torch.int32)
LongTensor = _legacy("LongTensor", torch.int64)
HalfTensor = _legacy("HalfTensor", torch.float16)
BFloat16Tensor = _legacy("BFloat16Tensor", torch.bfloat16)
FloatTensor = _legacy("FloatTensor", torch.float32)
DoubleTensor = _legacy("DoubleTensor", torch.float64)


# -- submodules ------------------------------------------------------------------------------------------------------
def _submodule(name: str, attributes: dict[str, Any]) -> types.ModuleType:
    module = types.ModuleType(f"torch_npu.npu.{name}")
    module.__dict__.update(attributes)
    module.__all__ = [k for k in attributes if not k.startswith("_")]
    return module


def _names(*names: str) -> dict[str, Any]:
    return {n: globals()[n] for n in names}


memory = _submodule("memory", _names(
    "empty_cache", "memory_stats", "memory_stats_as_nested_dict", "reset_accumulated_memory_stats",
    "reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached", "memory_allocated",
    "max_memory_allocated", "memory_reserved", "max_memory_reserved", "memory_cached", "max_memory_cached",
    "memory_snapshot", "memory_summary", "get_allocator_backend", "_set_allocator_settings", "MemPool",
    "use_mem_pool", "mem_get_info", "set_per_process_memory_fraction", "get_per_process_memory_fraction"))
random = _submodule("random", _names(
    "get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all", "manual_seed", "manual_seed_all",
    "seed", "seed_all", "initial_seed"))
streams = _submodule("streams", _names("Stream", "Event"))
utils = _submodule("utils", _names(
    "synchronize", "set_device", "current_device", "_get_device_index", "device", "device_of", "StreamContext",
    "stream", "set_stream", "current_stream", "default_stream", "is_bf16_supported", "ipc_collect"))
_amp_autocast_mode = _submodule("amp.autocast_mode", {"autocast": _autocast, "custom_fwd": torch.amp.custom_fwd,
                                                      "custom_bwd": torch.amp.custom_bwd})
_amp_grad_scaler = _submodule("amp.grad_scaler", {"GradScaler": _GradScaler})
_amp_common = _submodule("amp.common", {"amp_definitely_not_available": lambda: False})
amp = _submodule("amp", {"autocast": _autocast, "GradScaler": _GradScaler, "custom_fwd": torch.amp.custom_fwd,
                         "custom_bwd": torch.amp.custom_bwd})
amp.__all__ = ["autocast", "GradScaler", "custom_fwd", "custom_bwd"]
amp.autocast_mode = _amp_autocast_mode
amp.grad_scaler = _amp_grad_scaler
amp.common = _amp_common

SUBMODULES = {"memory": memory, "random": random, "streams": streams, "utils": utils, "amp": amp,
              "amp.autocast_mode": _amp_autocast_mode, "amp.grad_scaler": _amp_grad_scaler,
              "amp.common": _amp_common}


def setup() -> None:
    """Fill the state that needs the device configured (called by install)."""
    global default_generators
    default_generators = _device.generators()
    _device.memory.observers.append(_observe_allocation)

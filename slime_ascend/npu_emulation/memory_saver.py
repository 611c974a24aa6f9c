"""TEST DOUBLE: torch_memory_saver's NPU build on the emulated device (see :mod:`slime_ascend.npu_emulation`).

Installed only on request (``install(memory_saver=True)`` or ``SLIME_ASCEND_EMULATE_MEMORY_SAVER=1``), because a
real torch_memory_saver (the CUDA/CPU build) is usually installed too: :func:`install` puts this module's API in
``sys.modules["torch_memory_saver"]`` (and its ``hooks.mode_preload`` / ``entrypoint`` submodules).

It follows the NPU build, sgl-project/sgl-kernel-npu ``contrib/torch_memory_saver`` (version 0.0.8): its Python API
(``region(tag, enable_cpu_backup)``, ``cuda_graph``, ``disable``, ``pause(tag)``, ``resume(tag)``,
``hook_mode``; no ``get_cpu_backup``, which the CUDA build has and slime's weight update calls), its default hook mode
(``TMS_HOOK_MODE``, else ``"torch"``), and its C core's rules (``TMS_INIT_ENABLE`` / ``TMS_INIT_ENABLE_CPU_BACKUP``
as the initial thread-local state, no nested regions, ``disable()`` only inside an active state, a second pause of
the same allocation fails as ``aclrtUnmapMem failed.``).

The ``preload`` hook mode is refused, as the build's README documents it unsupported (FAQ: "Since PTA accesses
aclrtMallocAlign32 via dlopen + dlsym, it is not possible to override this interface using LD_PRELOAD. As a result,
the preload mode ... [is] currently unsupported"): asking for ``hook_mode="preload"`` (or ``TMS_HOOK_MODE=preload``),
or running with the preload library in ``LD_PRELOAD`` (what slime's train actors get with ``offload_train``), raises
:class:`PreloadUnsupported` at the first use. The real build does not raise there: its hooks simply never see
torch_npu's allocations, so nothing is released at pause and the next allocation of the colocated engine runs out
of memory. ``configure_subprocess()`` sets no ``LD_PRELOAD`` on NPU, as the build's own does.

In ``torch`` mode, what is allocated on ``npu`` inside ``region()`` is tracked (the allocations of the region's
memory pool, :func:`slime_ascend.npu_emulation.npu_module.use_mem_pool`); ``pause`` releases their host memory
(the storages shrink to nothing; ``torch.npu.memory_allocated`` drops), ``resume`` gives it back, with the content
restored where ``enable_cpu_backup`` was set and otherwise filled with 0xFF bytes (the device's content is not
kept). Memory allocated outside any region, as Megatron's is in slime, is never paused.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import types
import weakref
from typing import Optional

from . import device as _device

VERSION = "0.0.8+emulated"
_TAG_DEFAULT = "default"
PRELOAD_LIBRARY = "torch_memory_saver_hook_mode_preload"
HOOK_MODE_ENV = "TMS_HOOK_MODE"
README_FAQ = ("Since PTA accesses aclrtMallocAlign32 via dlopen + dlsym, it is not possible to override this "
              "interface using LD_PRELOAD. As a result, the preload mode and the feature of releasing activation "
              "value memory in graph mode are currently unsupported.")


class PreloadUnsupported(RuntimeError):
    """The NPU build's documented limit: no ``preload`` hook mode."""


def _bool_env(name: str) -> bool:
    """The C core's ``get_bool_env_var``: 1/true/TRUE/yes/YES are true, anything else false."""
    return os.environ.get(name, "") in ("1", "true", "TRUE", "yes", "YES")


class _ThreadConfig(threading.local):
    """The C core's ``thread_local_config``."""

    def __init__(self) -> None:
        self.tag = _TAG_DEFAULT
        self.interesting: bool | None = None
        self.cpu_backup: bool | None = None

    def interesting_region(self) -> bool:
        if self.interesting is None:
            self.interesting = _bool_env("TMS_INIT_ENABLE")
        return self.interesting

    def enable_cpu_backup(self) -> bool:
        if self.cpu_backup is None:
            self.cpu_backup = _bool_env("TMS_INIT_ENABLE_CPU_BACKUP")
        return self.cpu_backup

    def set(self, *, tag: str, interesting_region: bool, enable_cpu_backup: bool) -> None:
        self.tag, self.interesting, self.cpu_backup = tag, interesting_region, enable_cpu_backup


class _Allocation:
    __slots__ = ("storage", "nbytes", "device", "tag", "cpu_backup", "backup", "paused")

    def __init__(self, storage, device: int, tag: str, cpu_backup: bool) -> None:
        self.storage = weakref.ref(storage)
        self.nbytes = storage.nbytes()
        self.device = device
        self.tag = tag
        self.cpu_backup = cpu_backup
        self.backup = None
        self.paused = False


class _Core:
    """The C core (``TorchMemorySaver::instance()``): allocation metadata, pause and resume."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.allocations: dict[int, _Allocation] = {}
        self.config = _ThreadConfig()

    def record(self, storage, device: int) -> None:
        if not self.config.interesting_region():
            raise RuntimeError("only support interesting region")  # tms_torch_malloc's SIMPLE_CHECK
        key = storage._cdata
        allocation = _Allocation(storage, device, self.config.tag, self.config.enable_cpu_backup())
        with self.lock:
            self.allocations[key] = allocation
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        with self.lock:
            allocation = self.allocations.pop(key, None)
        if allocation is not None and allocation.paused:
            _device.released -= 1

    def _matching(self, tag: str) -> list[_Allocation]:
        with self.lock:
            return [a for a in self.allocations.values() if not tag or a.tag == tag]

    def pause(self, tag: str) -> None:
        import torch

        for allocation in self._matching(tag):
            storage = allocation.storage()
            if storage is None:
                continue
            if allocation.paused:
                raise RuntimeError("aclrtUnmapMem failed.")
            if allocation.cpu_backup:
                allocation.backup = torch.empty(allocation.nbytes, dtype=torch.uint8)
                allocation.backup.untyped_storage().copy_(storage)
            storage.resize_(0)
            allocation.paused = True
            _device.released += 1

    def resume(self, tag: str) -> None:
        import torch

        for allocation in self._matching(tag):
            storage = allocation.storage()
            if storage is None or not allocation.paused:
                continue
            storage.resize_(allocation.nbytes)
            _device.released -= 1
            if allocation.cpu_backup:
                storage.copy_(allocation.backup.untyped_storage())
            else:
                storage.copy_(torch.full((allocation.nbytes,), 0xFF, dtype=torch.uint8).untyped_storage())
            allocation.paused = False


_core = _Core()


def _preload_in_ld_preload() -> bool:
    return PRELOAD_LIBRARY in os.environ.get("LD_PRELOAD", "")


def _refuse_preload(why: str) -> None:
    raise PreloadUnsupported(f"torch_memory_saver (NPU build, emulated): {why}, but the preload hook mode is "
                             f"unsupported on NPU (sgl-kernel-npu contrib/torch_memory_saver README, FAQ: "
                             f"\"{README_FAQ}\"). Fix: use hook_mode=\"torch\" and allocate what must be paused "
                             "inside torch_memory_saver.region().")


class TorchMemorySaver:
    """``torch_memory_saver.TorchMemorySaver`` of the NPU build (``entrypoint.py``)."""

    def __init__(self) -> None:
        self._impl_ctor_kwargs: Optional[dict] = {}
        self._impl: Optional[_TorchMemorySaverImpl] = None

    @contextlib.contextmanager
    def region(self, tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False):
        """Context manager for memory saving with optional tag"""
        self._ensure_initialized()
        with self._impl.region(tag=tag, enable_cpu_backup=enable_cpu_backup):
            yield

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global", tag: str = _TAG_DEFAULT,
                   enable_cpu_backup: bool = False):
        self._ensure_initialized()
        with self._impl.cuda_graph(cuda_graph=cuda_graph, pool=pool, stream=stream,
                                   capture_error_mode=capture_error_mode, tag=tag,
                                   enable_cpu_backup=enable_cpu_backup):
            yield

    @contextlib.contextmanager
    def disable(self):
        self._ensure_initialized()
        with self._impl.disable():
            yield

    def pause(self, tag: Optional[str] = None) -> None:
        """Pause memory for specific tag or all memory if tag is None"""
        self._ensure_initialized()
        self._impl.pause(tag=tag)

    def resume(self, tag: Optional[str] = None) -> None:
        """Resume memory for specific tag or all memory if tag is None"""
        self._ensure_initialized()
        self._impl.resume(tag=tag)

    @property
    def enabled(self) -> bool:
        return True

    @property
    def hook_mode(self):
        raise AttributeError

    @hook_mode.setter
    def hook_mode(self, hook_mode: str) -> None:
        assert self._impl_ctor_kwargs is not None, "Cannot configure after initialization"
        self._impl_ctor_kwargs["hook_mode"] = hook_mode

    def _ensure_initialized(self) -> None:
        if self._impl is not None:
            return
        self._impl = _TorchMemorySaverImpl(**self._impl_ctor_kwargs)
        self._impl_ctor_kwargs = None


class _TorchMemorySaverImpl:
    def __init__(self, hook_mode: Optional[str] = None) -> None:
        import torch

        if hook_mode is None:
            hook_mode = os.environ.get(HOOK_MODE_ENV, "torch")
        if hook_mode == "preload":
            _refuse_preload("hook_mode=\"preload\" was asked for")
        if hook_mode != "torch":
            raise KeyError(hook_mode)  # HookUtilBase.create's dict lookup
        if _preload_in_ld_preload():
            _refuse_preload(f"LD_PRELOAD names {PRELOAD_LIBRARY} (slime sets it for offload_train)")
        self._hook_mode = hook_mode
        self._mem_pool = torch.npu.MemPool()
        self._mem_pool.observers.append(_core.record)
        _sanity_checks()

    @contextlib.contextmanager
    def region(self, tag: str, enable_cpu_backup: bool):
        import torch

        with torch.npu.use_mem_pool(self._mem_pool):
            with self._with_region_config(tag=tag, enable_cpu_backup=enable_cpu_backup):
                yield

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool, stream, capture_error_mode, tag: str, enable_cpu_backup: bool):
        assert self._hook_mode == "preload", "Only hook_mode=preload supports pauseable CUDA Graph currently"
        yield  # unreachable: the preload mode is refused at initialisation

    @contextlib.contextmanager
    def _with_region_config(self, tag: str, enable_cpu_backup: bool):
        assert not _core.config.interesting_region()
        _core.config.set(tag=tag, interesting_region=True, enable_cpu_backup=enable_cpu_backup)
        try:
            yield
        finally:
            assert _core.config.interesting_region()
            _core.config.set(tag=_TAG_DEFAULT, interesting_region=False, enable_cpu_backup=False)

    @contextlib.contextmanager
    def disable(self, dispose_mem_pool_after_use: bool = True):
        import torch

        if not dispose_mem_pool_after_use:
            raise ValueError("Only dispose_mem_pool_after_use=True is supported now")
        if not _core.config.interesting_region():
            raise RuntimeError("disable() should be called only when tms is active")
        _core.config.interesting = False
        try:
            pool = torch.npu.MemPool()
            with torch.npu.use_mem_pool(pool):
                yield
            torch.npu.synchronize()
            del pool
        finally:
            _core.config.interesting = True

    def pause(self, tag: Optional[str]) -> None:
        _core.pause(tag or "")

    def resume(self, tag: Optional[str]) -> None:
        _core.resume(tag or "")


def _sanity_checks() -> None:
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        raise RuntimeError(
            "TorchMemorySaver is disabled for the current process because expandable_segments is not supported yet.")


@contextlib.contextmanager
def configure_subprocess():
    """Only needed for hook_mode=preload; on NPU the build sets nothing (no LD_PRELOAD interception)."""
    yield


def install() -> types.ModuleType:
    """Put the emulated NPU build in ``sys.modules["torch_memory_saver"]`` (replacing any imported one)."""
    package = types.ModuleType("torch_memory_saver")
    package.__file__ = __file__
    package.__path__ = []
    package.__version__ = VERSION
    package._SLIME_ASCEND_EMULATED = True
    package.TorchMemorySaver = TorchMemorySaver
    package.configure_subprocess = configure_subprocess
    package.torch_memory_saver = TorchMemorySaver()
    entrypoint = types.ModuleType("torch_memory_saver.entrypoint")
    entrypoint.TorchMemorySaver = TorchMemorySaver
    entrypoint._TorchMemorySaverImpl = _TorchMemorySaverImpl
    hooks = types.ModuleType("torch_memory_saver.hooks")
    hooks.__path__ = []
    mode_preload = types.ModuleType("torch_memory_saver.hooks.mode_preload")
    mode_preload.configure_subprocess = configure_subprocess
    hooks.mode_preload = mode_preload
    package.entrypoint, package.hooks = entrypoint, hooks
    for module in (package, entrypoint, hooks, mode_preload):
        sys.modules[module.__name__] = module
    return package

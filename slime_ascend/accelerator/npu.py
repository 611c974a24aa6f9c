"""The ``npu`` backend for slime's accelerator registry (``slime.utils.accelerator``).

Written against torch's generic device-module API (``torch.get_device_module``): the same class
runs on ``npu`` on Ascend and, for tests, on ``cpu`` or ``cuda`` (:func:`accelerator_class`
with another ``device_type``). Importing this module imports neither torch_npu nor slime; the
class is built on first use, as a subclass of slime's ``TorchAccelerator``.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any

from .. import host

logger = logging.getLogger("slime_ascend.accelerator")

NAME = "npu"
PRIORITY = 300  # above cuda (100) and musa (200): an Ascend host with a stray CUDA torch still picks npu
COMMUNICATION_BACKEND = "hccl"
VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"
RAY_RESOURCE = "NPU"


def load_torch_npu() -> Any:
    """Import torch_npu (it attaches ``torch.npu``); None when it is not installed."""
    if not host.torch_npu_installed():
        return None
    return importlib.import_module("torch_npu")


def is_npu_available() -> bool:
    """Availability probe: never raises, never imports torch_npu when it is not installed."""
    try:
        if load_torch_npu() is None:
            return False
        import torch

        module = getattr(torch, "npu", None)
        return bool(module is not None and module.is_available() and module.device_count() > 0)
    except Exception as exc:  # noqa: BLE001 - a broken CANN install reads as "not available"
        logger.warning("torch_npu is installed but unusable: %s", exc)
        return False


class _AscendIdentity:
    """What makes a backend ``npu`` to slime, whatever runs its device operations: HCCL, Ray's ``NPU``
    resource, ``ASCEND_RT_VISIBLE_DEVICES``, no ``device_id`` for process groups, the capabilities
    Ascend lacks."""

    communication_backend_name = COMMUNICATION_BACKEND

    @property
    def visible_devices_env(self) -> str:
        return VISIBLE_DEVICES_ENV

    def communication_backend(self, default: str = "nccl") -> str:
        return self.communication_backend_name if default in ("nccl", "hccl") else default

    def weight_update_backend(self, default: str = "nccl") -> str:
        return self.communication_backend(default)

    def distributed_device_id(self, index=None):
        return None  # HCCL takes no device_id in init_process_group

    def supports(self, capability: str) -> bool:
        if capability in {"nvml_affinity", "sglang_fp8_utils", "strict_fp32_logits", "torch_compile"}:
            return False
        return super().supports(capability)

    def ray_resource_name(self) -> str:
        return RAY_RESOURCE


@functools.lru_cache(maxsize=None)
def accelerator_class(device_type: str = NAME) -> type:
    """slime ``Accelerator`` subclass for ``device_type``.

    ``npu``: device operations through ``torch.npu`` (torch_npu). ``cuda``: the same class over
    ``torch.cuda`` (tests on a GPU). ``cpu``: the ``npu`` identity over the host's device operations
    (the ``cpu`` plugin's accelerator): what ``npu`` on the host (plugins ``cpu,npu``, see
    :func:`slime_ascend.host.on_host`) registers, so slime's loop runs every ``npu`` code
    path that does not need the chip; its transport is gloo.
    """
    if device_type == "cpu":
        from slime.utils.accelerator.base import Accelerator

        from ..cpu.accelerator import COMMUNICATION_BACKEND as HOST_BACKEND
        from ..cpu.accelerator import accelerator_class as host_accelerator_class

        class AscendOnHostAccelerator(_AscendIdentity, host_accelerator_class()):
            name = f"{NAME}-as-cpu"
            communication_backend_name = HOST_BACKEND

            def communication_backend(self, default: str = "nccl") -> str:
                return HOST_BACKEND if default in ("nccl", "hccl", "gloo") else default

            def resolve_visible_device_id(self, physical_device_id) -> int:
                # slime's rule under ASCEND_RT_VISIBLE_DEVICES (which Ray sets for NPU workers), not the
                # host's "always device 0"
                return Accelerator.resolve_visible_device_id(self, physical_device_id)

        AscendOnHostAccelerator.__qualname__ = "AscendAccelerator[cpu]"
        return AscendOnHostAccelerator

    import torch
    from slime.utils.accelerator.torch_accelerator import TorchAccelerator

    class AscendAccelerator(_AscendIdentity, TorchAccelerator):
        name = NAME if device_type == NAME else f"{NAME}-as-{device_type}"
        communication_backend_name = COMMUNICATION_BACKEND if device_type == NAME else "nccl"

        def __init__(self) -> None:
            self.device_type = device_type
            if device_type == NAME:
                load_torch_npu()

        def _module(self) -> Any:
            module = torch.get_device_module(self.device_type)
            if module is None:
                raise RuntimeError(f"torch has no device module for {self.device_type!r}")
            return module

        def is_available(self) -> bool:
            if self.device_type == NAME:
                return is_npu_available()
            return bool(self._module().is_available())

        def current_device(self) -> int:
            value = self._module().current_device()
            return int(value) if str(value).isdigit() else 0

        def post_import_torch(self) -> None:
            if self.device_type == NAME:
                load_torch_npu()

    AscendAccelerator.__qualname__ = f"AscendAccelerator[{device_type}]"
    return AscendAccelerator


def make_accelerator() -> Any:
    return accelerator_class(NAME)()


def make_host_accelerator() -> Any:
    return accelerator_class("cpu")()


def register(accelerator_module: Any, *, on_host: bool = False) -> None:
    """Register ``npu`` in slime's accelerator registry (``accelerator_module`` is
    ``slime.utils.accelerator``). Idempotent. ``on_host``: the ``npu`` identity over the host's
    device operations (always available, gloo), for plugins ``cpu,npu`` on a host without torch_npu."""
    if on_host:
        from ..cpu.accelerator import COMMUNICATION_BACKEND as HOST_BACKEND

        accelerator_module.register_accelerator(NAME, make_host_accelerator, lambda: True, priority=PRIORITY,
                                                communication_backends=(HOST_BACKEND,))
        logger.debug("registered the npu accelerator on the host (priority %d, %s)", PRIORITY, HOST_BACKEND)
        return
    accelerator_module.register_accelerator(
        NAME,
        make_accelerator,
        is_npu_available,
        priority=PRIORITY,
        communication_backends=(COMMUNICATION_BACKEND,),
    )
    logger.debug("registered the npu accelerator (priority %d, %s)", PRIORITY, COMMUNICATION_BACKEND)

"""The ``train.cpu_*`` patches (the CPU counterpart of torch_npu's ``transfer_to_npu``): torch attributes
replaced by or wrapped in :mod:`slime_ascend.cpu.cuda_shims`. They only ever apply to a torch without a
usable CUDA device."""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs


@dataclasses.dataclass
class CudaShims(RuntimePatch):
    """``replaced`` and ``wrapped`` map an attribute path below ``torch`` (``"cuda.current_device"``) to its shim
    and to its wrapper factory; ``required`` names attributes the shims need without changing them."""

    replaced: dict[str, Any] = dataclasses.field(default_factory=dict)
    wrapped: dict[str, Callable[[Any], Any]] = dataclasses.field(default_factory=dict)
    required: tuple[str, ...] = ()

    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        torch_module = modules["torch"]
        problems = missing_attrs(torch_module, [*self.replaced, *self.wrapped, *self.required])
        try:
            if torch_module.cuda.is_available():
                problems.append("torch.cuda.is_available() is True: the cpu shims must not replace a working CUDA "
                                "(drop the `cpu` plugin on this host)")
        except Exception:  # noqa: BLE001 - a broken CUDA build reads as absent
            pass
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        _prime_device_constructors(modules["torch"])
        for path, shim in self.replaced.items():
            self.replace(*_owner(modules["torch"], path), shim)
        for path, wrapper in self.wrapped.items():
            self.wrap(*_owner(modules["torch"], path), wrapper)


def _prime_device_constructors(torch_module: ModuleType) -> None:
    """Fill torch's cache of the factories a ``with torch.device(...)`` context places before any is wrapped.

    ``torch.utils._device._device_constructors()`` is an ``lru_cache`` filled on first use. Filled while our
    wrappers stand in for ``torch.empty`` and the rest, it would hold the wrappers, and every later
    ``torch.device("meta")`` context (transformers' ``from_pretrained``) would stop placing torch's own factories
    for the rest of the process."""
    try:
        device_module = importlib.import_module(f"{torch_module.__name__}.utils._device")
    except ImportError:  # a torch without device contexts has no cache to fill
        return
    constructors = getattr(device_module, "_device_constructors", None)
    if callable(constructors):
        constructors()


def _owner(torch_module: ModuleType, path: str) -> tuple[Any, str]:
    *owner, attr = path.split(".")
    return functools.reduce(getattr, owner, torch_module), attr

"""The ``train.cpu_*`` patches (the CPU counterpart of torch_npu's ``transfer_to_npu``): torch attributes
replaced by or wrapped in :mod:`slime_ascend.cpu.cuda_shims`. They only ever apply to a torch without a
usable CUDA device."""

from __future__ import annotations

import dataclasses
import functools
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
        for path, shim in self.replaced.items():
            self.replace(*_owner(modules["torch"], path), shim)
        for path, wrapper in self.wrapped.items():
            self.wrap(*_owner(modules["torch"], path), wrapper)


def _owner(torch_module: ModuleType, path: str) -> tuple[Any, str]:
    *owner, attr = path.split(".")
    return functools.reduce(getattr, owner, torch_module), attr

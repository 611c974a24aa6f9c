"""The loader interface between :class:`~slime_ascend.opd.pool.TeacherPool` and whatever holds the teacher
weights, and the in-process loaders:

* :class:`TorchModuleLoader`: an in-process ``torch.nn.Module`` (``load_state_dict``).
* :class:`WeightDictLoader`: megatron-mode "weight backup" swap, in-place ``copy_`` into a dict
  of live tensors.

Staging reads the checkpoint into pinned host memory when an accelerator is present, plain host memory on
CPU; activation is the host->device copy (or an in-memory ``assign`` on CPU). The HTTP engine loader is
:class:`~slime_ascend.opd.engine_loader.SGLangEngineLoader`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from slime_ascend.opd.safetensors_dir import read_safetensors_dir, validate_safetensors_dir
from slime_ascend.opd.teachers import TeacherSpec

__all__ = ["accelerator_available", "Staged", "TeacherLoader", "TorchModuleLoader", "WeightDictLoader"]


def accelerator_available() -> bool:
    """True when torch sees an accelerator (CUDA, or a registered backend such as NPU)."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        try:
            return bool(acc.is_available())
        except Exception:  # pragma: no cover - defensive, backend probing can raise
            pass
    return torch.cuda.is_available()


@dataclass
class Staged:
    """A teacher staged for activation: loader-specific ``payload`` plus its host-memory size."""

    name: str
    payload: Any
    host_bytes: int = 0
    read_bytes: int = 0  # bytes read from the checkpoint to stage it (0: an earlier copy was reused)


class TeacherLoader(ABC):
    """Adapter between the pool and whatever holds the teacher weights.

    ``stage`` runs on the pool's background thread (no device work other than pinned host
    allocation); ``activate`` runs on the caller's thread and makes the staged teacher resident,
    returning the host bytes it keeps resident afterwards (e.g. CPU tensors handed to a CPU model).
    """

    def validate(self, spec: TeacherSpec) -> None:
        """Cheap start-up check of the teacher's checkpoint; raise to mark it failed."""
        validate_safetensors_dir(spec.checkpoint_dir)

    @abstractmethod
    def stage(self, spec: TeacherSpec) -> Staged: ...

    @abstractmethod
    def activate(self, spec: TeacherSpec, staged: Staged) -> int: ...

    def release(self, spec: TeacherSpec) -> None:
        """Called after ``spec`` stopped being resident (default: nothing to do)."""

    def take_garbage(self) -> Any:
        """Memory left over by the last ``activate`` (old weights, used staging buffers), or None.

        The pool frees it on its background thread, before the next prefetch, so that
        deallocating hundreds of MiB (or unpinning host memory) stays out of the switch stall.
        """
        garbage, self._garbage = getattr(self, "_garbage", None), None
        return garbage

    def discard(self, staged: Staged) -> None:
        """Drop a staged teacher that will not be activated (default: let GC free it)."""
        staged.payload = None

    def close(self) -> None:
        """The pool is closing: leave what the loader joined (default: nothing)."""


def _placement(first: torch.Tensor | None, pin_memory: bool | None) -> tuple[torch.device, bool]:
    """The live weights' device (CPU when there are none) and whether staged tensors are pinned."""
    device = first.device if first is not None else torch.device("cpu")
    if pin_memory is None:
        return device, device.type != "cpu" and accelerator_available()
    return device, bool(pin_memory) and accelerator_available()


def _synchronize(device: torch.device) -> None:
    if device.type == "cpu":
        return
    mod = getattr(torch, device.type, None)
    if mod is not None and hasattr(mod, "synchronize"):
        mod.synchronize()


class TorchModuleLoader(TeacherLoader):
    """Drive an in-process ``nn.Module`` whose weights are replaced per teacher.

    Args:
        model: the teacher module (same architecture for all teachers).
        mode: ``"assign"`` (``load_state_dict(assign=True)``: the staged tensors become the
            parameters, zero-copy on CPU), ``"copy"`` (``copy_`` into the existing parameters,
            the host->device path), or ``"auto"`` (assign on CPU, copy otherwise).
        pin_memory: pin staged tensors; default: only when the model is on an accelerator.
        key_map: optional checkpoint-key -> state-dict-key renaming (None drops a key).
        strict: passed to ``load_state_dict``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        mode: str = "auto",
        pin_memory: bool | None = None,
        key_map: Callable[[str], str | None] | None = None,
        strict: bool = True,
    ) -> None:
        if mode not in ("auto", "assign", "copy"):
            raise ValueError(f"mode must be 'auto', 'assign' or 'copy', got {mode!r}")
        self.model = model
        self.device, self.pin = _placement(next(iter(model.parameters()), None), pin_memory)
        self.mode = ("assign" if self.device.type == "cpu" else "copy") if mode == "auto" else mode
        self.key_map = key_map
        self.strict = strict

    def stage(self, spec: TeacherSpec) -> Staged:
        state, nbytes = read_safetensors_dir(spec.checkpoint_dir, pin_memory=self.pin, key_map=self.key_map)
        return Staged(spec.name, state, nbytes)

    def activate(self, spec: TeacherSpec, staged: Staged) -> int:
        state, on_cpu = staged.payload, self.device.type == "cpu"
        if self.mode == "assign":
            old = list(self.model.state_dict().values())  # freed later, off the stall path
            if not on_cpu:
                state = {k: v.to(self.device, non_blocking=self.pin) for k, v in state.items()}
            self.model.load_state_dict(state, strict=self.strict, assign=True)
            self._garbage = [old, None if on_cpu else staged.payload]
        else:
            with torch.no_grad():
                self.model.load_state_dict(state, strict=self.strict)
            self._garbage = staged.payload
        _synchronize(self.device)
        staged.payload = None
        return staged.host_bytes if self.mode == "assign" and on_cpu else 0  # assigned CPU tensors stay resident


class WeightDictLoader(TeacherLoader):
    """Megatron-mode "weight backup" swap: copy a staged host dict into live tensors in place.

    ``targets`` maps names to the live (device) tensors, e.g. ``dict(model.named_parameters())``
    over all model chunks, or a callable returning such a mapping. Each teacher checkpoint must
    provide every target name with the same shape (``key_map`` renames checkpoint keys).
    """

    def __init__(
        self,
        targets: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]],
        *,
        pin_memory: bool | None = None,
        key_map: Callable[[str], str | None] | None = None,
    ) -> None:
        self._targets = targets
        self.device, self.pin = _placement(next(iter(self.targets().values()), None), pin_memory)
        self.key_map = key_map

    def targets(self) -> Mapping[str, torch.Tensor]:
        return self._targets() if callable(self._targets) else self._targets

    def stage(self, spec: TeacherSpec) -> Staged:
        state, nbytes = read_safetensors_dir(spec.checkpoint_dir, pin_memory=self.pin, key_map=self.key_map)
        live = self.targets()
        missing = [k for k in live if k not in state]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weight(s), e.g. {missing[0]!r}")
        for k, t in live.items():
            if tuple(state[k].shape) != tuple(t.shape):
                raise ValueError(f"weight {k!r}: checkpoint shape {tuple(state[k].shape)} != live {tuple(t.shape)}")
        return Staged(spec.name, state, nbytes)

    def activate(self, spec: TeacherSpec, staged: Staged) -> int:
        state = staged.payload
        with torch.no_grad():
            for k, t in self.targets().items():
                t.copy_(state[k], non_blocking=self.pin)
        _synchronize(self.device)
        self._garbage = state
        staged.payload = None
        return 0

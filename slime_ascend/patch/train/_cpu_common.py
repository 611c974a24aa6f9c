"""Shared target check of the ``train.cpu_*`` patches (the CPU counterpart of torch_npu's
``transfer_to_npu``): they only ever apply to a torch without a usable CUDA device."""

from __future__ import annotations

from types import ModuleType

from ..base import missing_attrs


def cuda_absent_problems(torch_module: ModuleType, attrs: tuple[str, ...]) -> list[str]:
    problems = missing_attrs(torch_module, attrs)
    try:
        if torch_module.cuda.is_available():
            problems.append("torch.cuda.is_available() is True: the cpu shims must not replace a working CUDA "
                            "(drop the `cpu` plugin on this host)")
    except Exception as exc:  # noqa: BLE001 - a broken CUDA build reads as absent
        del exc
    return problems

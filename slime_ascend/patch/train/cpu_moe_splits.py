"""Megatron's all-to-all MoE dispatcher reads its split sizes as numpy only from CUDA tensors.

``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` turns ``input_splits`` / ``output_splits`` /
``output_splits_tp`` into host values with ``moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)``, which
converts only a tensor that ``is_cuda``. On the host the splits are CPU tensors already and stay tensors, and
``torch.distributed.all_to_all_single`` (torch 2.14) accepts only a sequence of ints for its split sizes: an
expert-parallel MoE layer stops in its first token dispatch. token_dispatcher imports the function by name
(``from ...moe_utils import maybe_move_tensor_to_cpu``), so both bindings are wrapped, when the dispatcher is
imported (moe_utils is complete then, and the dispatcher holds the original).
"""

from __future__ import annotations

import functools
import inspect
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source, param_mismatch

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
NAME = "maybe_move_tensor_to_cpu"


def host_splits(original):
    """``original`` that also gives a CPU tensor's numpy form for ``as_numpy=True``, as it does for a CUDA
    tensor (a copy: the CUDA path copies to the host, and Megatron's splits are views of its token counts)."""

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        import torch

        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.detach().numpy().copy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


class CpuMoeSplits(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        utils, dispatcher = modules[MOE_UTILS], modules[DISPATCHER]
        problems = missing_attrs(utils, [NAME]) + missing_attrs(dispatcher, [NAME, "MoEAlltoAllTokenDispatcher"])
        if problems:
            return problems
        function = inspect.unwrap(getattr(utils, NAME))
        problems += param_mismatch(function, ["tensor", "as_numpy", "record_stream"])
        problems += missing_source(function, ["tensor.is_cuda", "cpu_tensor.numpy()"])
        if inspect.unwrap(getattr(dispatcher, NAME)) is not function:
            problems.append(f"{DISPATCHER}.{NAME} is not {MOE_UTILS}.{NAME} (no longer imported by name)")
        sync = dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize
        problems += missing_source(sync, ["self.input_splits = maybe_move_tensor_to_cpu(", "as_numpy=True"])
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        for name in (MOE_UTILS, DISPATCHER):
            self.wrap(modules[name], NAME, host_splits)


PATCH = CpuMoeSplits(
    id="train.cpu_moe_splits",
    targets=(f"{MOE_UTILS}:{NAME}", f"{DISPATCHER}:{NAME}"),
    why="Megatron's all-to-all MoE dispatcher gets its split sizes from maybe_move_tensor_to_cpu(as_numpy=True), "
    "which converts CUDA tensors only; on the host they stay tensors and torch 2.14's all_to_all_single refuses "
    "them, so --expert-model-parallel-size above 1 stops in the first token dispatch.",
    how="Wrap maybe_move_tensor_to_cpu (in moe_utils and its by-name import in token_dispatcher): for "
    "as_numpy=True a CPU tensor also becomes a numpy copy, as a CUDA tensor does; everything else goes to the "
    "original. Installed when token_dispatcher is imported, only where torch.cuda.is_available() is False.",
    upstream="patches/megatron/megatron-moe-host-splits.md",
    checked_on=("0.3.1",),
)

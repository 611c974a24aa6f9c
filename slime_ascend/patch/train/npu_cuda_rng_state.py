"""Megatron's RNG tracker sets the device's random state through ``torch.npu.default_generators`` (MindSpeed's
``_set_cuda_rng_state``), without MindSpeed.

``megatron.core.tensor_parallel.random._set_cuda_rng_state`` (newer torch) indexes
``torch.cuda.default_generators``. ``transfer_to_npu`` redirects ``torch.cuda``'s functions to ``torch.npu`` but
not that tuple (it is torch's own, empty without CUDA), so ``model_parallel_cuda_manual_seed`` (slime's Megatron
init), every ``get_cuda_rng_tracker().fork()`` (dropout, weight init of tensor-parallel layers) and activation
recompute raise ``IndexError`` on Ascend. MindSpeed's adaptor replaces the function with one that indexes
``torch.npu.default_generators`` (Ascend/MindSpeed 0.12.1, commit 028de58c:
``mindspeed/features_manager/megatron_basic/megatron_basic.py:72-74`` registers
``mindspeed/core/megatron_basic/megatron_basic.py:22`` ``_set_cuda_rng_state``). This patch is that function for an
Ascend host without MindSpeed (:func:`slime_ascend.accelerator.plugin.without_mindspeed`).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source, param_mismatch

TARGET = "megatron.core.tensor_parallel.random"


def make_set_cuda_rng_state(random_module: ModuleType):
    """MindSpeed's ``_set_cuda_rng_state``: Megatron's function with ``torch.npu.default_generators``."""
    import torch

    def _set_cuda_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
        if device == -1:
            device = torch.device("cuda")  # transfer_to_npu: the current npu device
        elif isinstance(device, str):
            device = torch.device(device)
        elif isinstance(device, int):
            device = torch.device("cuda", device)

        def cb():
            idx = device.index
            if idx is None:
                idx = torch.cuda.current_device()
            default_generator = torch.npu.default_generators[idx]
            if graph_safe:
                default_generator.graphsafe_set_state(new_state)
            else:
                default_generator.set_state(new_state)

        random_module._lazy_call(cb)

    return _set_cuda_rng_state


class NpuCudaRngState(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        random_module = modules[TARGET]
        import torch

        problems = missing_attrs(random_module, ["_set_cuda_rng_state", "_lazy_call"])
        problems += missing_attrs(torch, ["npu.default_generators"])  # torch_npu loaded
        if hasattr(random_module, "_set_cuda_rng_state"):
            fn = random_module._set_cuda_rng_state
            problems += param_mismatch(fn, ["new_state", "device", "graph_safe"], f"{TARGET}._set_cuda_rng_state")
            problems += missing_source(fn, ["torch.cuda.default_generators[idx]"], f"{TARGET}._set_cuda_rng_state")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        random_module = modules[TARGET]
        self.replace(random_module, "_set_cuda_rng_state", make_set_cuda_rng_state(random_module))


PATCH = NpuCudaRngState(
    id="train.npu_cuda_rng_state",
    targets=(f"{TARGET}:_set_cuda_rng_state",),
    why="Megatron's _set_cuda_rng_state indexes torch.cuda.default_generators, which transfer_to_npu leaves as "
    "torch's own (empty on Ascend): model_parallel_cuda_manual_seed and every RNG-tracker fork raise IndexError. "
    "MindSpeed replaces the function (mindspeed/features_manager/megatron_basic/megatron_basic.py:72-74, its "
    "_set_cuda_rng_state at mindspeed/core/megatron_basic/megatron_basic.py:22, MindSpeed 0.12.1 commit 028de58c).",
    how="megatron.core.tensor_parallel.random._set_cuda_rng_state -> MindSpeed's: the same lazy call on "
    "torch.npu.default_generators[idx]. Only on an Ascend host without MindSpeed (callers in Megatron look it up "
    "in the module at each call).",
    upstream="patches/megatron/megatron-device-neutral-placement.md",
    checked_on=("0.3.1",),
    needs_loaded=("torch_npu",),  # it runs where torch_npu is loaded; elsewhere there is nothing to check
)

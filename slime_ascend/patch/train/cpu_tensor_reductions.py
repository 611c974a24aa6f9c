"""slime's colocated push pickles host tensors after sglang's CUDA-only tensor reducer is installed.

Before gathering the full parameters for a weight push, slime's HF weight iterator
(``slime/backends/megatron_utils/update_weight/hf_weight_iterator_direct.py``, ``_get_megatron_full_params``)
calls sglang's ``monkey_patch_torch_reductions``, which replaces torch's ``reductions.reduce_tensor`` (the
reducer ``ForkingPickler`` uses for every tensor) with one that rewrites argument 6 of the result, a CUDA
tensor's device index, into the device's UUID. For any other tensor torch's reducer returns three arguments,
so from then on every ``MultiprocessingSerializer.serialize`` of a host tensor fails with ``IndexError: tuple
index out of range``: under ``--colocate`` on the host, ``_send_to_colocated_engine`` cannot serialise the
first bucket of ``update_weights_from_tensor`` (slime's IPC handles are CUDA handles; on the host they are
torch's shared-memory files).

The wrapper runs slime's call unchanged and then, if sglang installed its reducer, puts a device-neutral one
in front of it: a CUDA tensor goes to sglang's reducer (what slime gets on a GPU, unchanged), any other tensor
to torch's own (the one sglang saved as ``reductions._reduce_tensor_original``), and registers it with
``ForkingPickler`` as sglang's call did (``reductions.init_reductions``). On Ascend sglang patches only the
NPU rebuild function, not the reducer, and nothing is changed there. slime's module looks the name up at each
call (``monkey_patch_torch_reductions()`` in ``_get_megatron_full_params``), so replacing its binding is enough.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source

MODULE = "slime.backends.megatron_utils.update_weight.hf_weight_iterator_direct"
ATTR = "monkey_patch_torch_reductions"
MARK = "__slime_ascend_device_neutral__"


def device_neutral_reducer() -> bool:
    """Put the device-neutral reducer in front of sglang's, if sglang's is installed; True if it is (now or
    already) in place."""
    from torch.multiprocessing import reductions

    installed = reductions.reduce_tensor
    if getattr(installed, MARK, False) or getattr(installed, "_slime_device_neutral", False):  # ours, or slime's
        return True  # own once patches/0024 is merged
    torch_reduce = getattr(reductions, "_reduce_tensor_original", None)
    if torch_reduce is None or installed is torch_reduce:  # sglang replaced nothing (its NPU branch)
        return False

    def reduce_tensor(tensor):
        if tensor.is_cuda:
            return installed(tensor)
        return torch_reduce(tensor)

    reduce_tensor.__wrapped__ = installed
    setattr(reduce_tensor, MARK, True)
    reductions.reduce_tensor = reduce_tensor
    reductions.init_reductions()  # ForkingPickler.register(tensor classes, reduce_tensor), as sglang's call did
    return True


def _wrap(original):
    @functools.wraps(original)
    def monkey_patch_torch_reductions(*args, **kwargs):
        out = original(*args, **kwargs)
        device_neutral_reducer()
        return out

    monkey_patch_torch_reductions.__slime_ascend_original__ = original
    return monkey_patch_torch_reductions


class CPUTensorReductions(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        module = modules[MODULE]
        problems = missing_attrs(module, [ATTR, "_get_megatron_full_params"])
        if problems:
            return problems
        problems += missing_source(module._get_megatron_full_params, [f"{ATTR}()"], "_get_megatron_full_params")
        from torch.multiprocessing import reductions

        problems += missing_attrs(reductions, ["reduce_tensor", "init_reductions"])
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        self.wrap(modules[MODULE], ATTR, _wrap)


PATCH = CPUTensorReductions(
    id="train.cpu_tensor_reductions",
    targets=(f"{MODULE}:{ATTR}",),
    why="slime's weight iterator installs sglang's tensor reducer, which assumes every tensor is a CUDA tensor "
        "(it rewrites argument 6, the device index): from then on pickling a host tensor for "
        "update_weights_from_tensor (--colocate on the host) fails with IndexError.",
    how="Wrap the iterator's monkey_patch_torch_reductions binding: after slime's call, CUDA tensors go to "
        "sglang's reducer and any other tensor to torch's own (re-registered with ForkingPickler); unchanged "
        "where sglang replaced no reducer (NPU).",
    upstream="patches/0024-colocated-push-device-neutral-reductions.patch",
    checked_on=("0.3.1",),
)

"""slime's ``ReloadableProcessGroup`` forwards the collectives torch >= 2.14 calls by their new names.

slime wraps every process group Megatron creates in ``slime.utils.reloadable_process_group.ReloadableProcessGroup``
(a ``torch.distributed.ProcessGroup`` subclass that forwards each collective to the inner group), and it forwards
``_reduce_scatter_base`` / ``_allgather_base`` / ``alltoall_base``, the names torch used to call. torch 2.14's
``reduce_scatter_tensor``, ``all_gather_into_tensor``, ``all_to_all_single`` and ``gather`` call
``group.reduce_scatter_single`` / ``all_gather_single`` / ``all_to_all_single`` / ``gather_single`` (and their
``_coalesced`` forms) instead, which the wrapper inherits from ``ProcessGroup`` unforwarded: the wrapper has no
backend of its own, so they fail with "No backend type associated with device type cpu" (Megatron's sequence
parallelism: the embedding's reduce-scatter to the sequence shards). Each missing name is forwarded as the
others are (``_fwd``, slime's memory check included).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source

MODULE = "slime.utils.reloadable_process_group"
NAMES = ("reduce_scatter_single", "reduce_scatter_single_coalesced", "all_gather_single",
         "all_gather_single_coalesced", "all_to_all_single", "gather_single")


def _forwarder(name: str):
    def forward(self, *args: Any, **kwargs: Any):
        return self._fwd(name, *args, **kwargs)

    forward.__name__ = name
    return forward


def unforwarded(cls: type) -> list[str]:
    """The collectives this torch's ProcessGroup has that ``cls`` does not define itself."""
    import torch.distributed as dist

    return [n for n in NAMES if hasattr(dist.ProcessGroup, n) and n not in vars(cls)]


class ReloadableGroupCollectives(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        module = modules[MODULE]
        problems = missing_attrs(module, ["ReloadableProcessGroup"])
        if not problems:
            problems += missing_attrs(module.ReloadableProcessGroup, ["_fwd", "_reduce_scatter_base"])
        if not problems:
            problems += missing_source(module.ReloadableProcessGroup._fwd, ["getattr(inner, method)"])
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        cls = modules[MODULE].ReloadableProcessGroup
        for name in unforwarded(cls):
            self.replace(cls, name, _forwarder(name))


PATCH = ReloadableGroupCollectives(
    id="train.reloadable_group_collectives",
    targets=(f"{MODULE}:ReloadableProcessGroup",),
    why="torch 2.14 calls reduce_scatter_single / all_gather_single / all_to_all_single on a process group; slime's "
    "ReloadableProcessGroup forwards only the older names, so sequence parallelism (and any such collective) fails.",
    how="Add a forwarding method (the wrapper's own _fwd) for each of those names the class does not define.",
    upstream="patches/0017-reloadable-group-forwards-single-collectives.patch",
    checked_on=("0.3.1",),
)

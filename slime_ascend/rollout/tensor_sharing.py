"""How CPU tensors cross processes in slime's colocated push (``update_weights_from_tensor``)."""

from __future__ import annotations

from typing import Any


def use_file_system_sharing(_module: Any = None) -> None:
    """Pickle CPU tensors as named shared-memory files (``file_system``), which an unrelated process (the
    engine) can open; the default ``file_descriptor`` handles reach children of the sender only."""
    import torch.multiprocessing as mp

    if mp.get_sharing_strategy() != "file_system":
        mp.set_sharing_strategy("file_system")

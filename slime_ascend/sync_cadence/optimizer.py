"""Reset an optimizer's states in place: Adam's step, first and second moments.

The same operations as slime's ``--reset-optimizer-states`` (``slime/backends/megatron_utils/model.py``,
which resets at the start of *every* rollout's training), over Megatron's chained optimizers or a plain
torch optimizer. Tensors are zeroed in place (Megatron's distributed optimizer keeps its states in
sharded buffers that must not be replaced).
"""

from __future__ import annotations

from typing import Any

import torch


def _optimizers(optimizer: Any) -> list[Any]:
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [getattr(c, "optimizer", c) for c in chained]
    return [getattr(optimizer, "optimizer", optimizer)]


def reset_optimizer_states(optimizer: Any) -> int:
    """Zero the step, ``exp_avg`` and ``exp_avg_sq`` of every parameter state; returns how many states
    held anything to reset (0: nothing trained yet)."""
    reset = 0
    for opt in _optimizers(optimizer):
        for group in getattr(opt, "param_groups", []):
            if "step" in group:
                group["step"] = 0
        for state in getattr(opt, "state", {}).values():
            if not state:
                continue
            reset += 1
            if "step" in state:
                if isinstance(state["step"], torch.Tensor):
                    state["step"].zero_()
                else:
                    state["step"] = 0
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key].zero_()
    return reset

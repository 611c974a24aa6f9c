"""Reset an optimizer's states in place: its step and every state tensor (Adam's first and second
moments, AMSGrad's maximum, SGD's momentum buffer).

The same operations as slime's ``--reset-optimizer-states`` (``slime/backends/megatron_utils/model.py``,
which resets at the start of *every* rollout's training), over Megatron's chained optimizers or a plain
torch optimizer. Tensors are zeroed in place (Megatron's distributed optimizer keeps its states in
sharded buffers that must not be replaced). slime's own reset zeroes only ``exp_avg`` and ``exp_avg_sq``;
every other state tensor is an accumulated moment too (SGD's ``momentum_buffer`` would otherwise carry
the pre-push direction into the next update), so all are zeroed.
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
    """Zero the step and every tensor of every parameter state; returns how many states held anything to
    reset (0: nothing trained yet)."""
    reset = 0
    for opt in _optimizers(optimizer):
        for group in getattr(opt, "param_groups", []):
            if "step" in group:
                group["step"] = 0
        for state in getattr(opt, "state", {}).values():
            held = False
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    value.zero_()
                    held = True
                elif key == "step" and value:
                    state[key] = 0
                    held = True
            reset += held
    return reset

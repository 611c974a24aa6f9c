"""Megatron's distributed optimizer over torch's own Adam (no TransformerEngine, no Apex) cannot resume a checkpoint.

Without TE's or Apex's ``FusedAdam`` (``distrib_optimizer.HAVE_APEX_OR_TE`` False: always on the host, and on a
GPU without either), Megatron-core's ``DistributedOptimizer`` wraps ``torch.optim.Adam``/``AdamW``, whose per-param
state, ``step`` included, is created lazily at its first ``step()``. TE's and Apex's FusedAdam keep the step in the
param groups instead, and the ``torch_dist`` load path of megatron-core 0.19.2
(``megatron/core/optimizer/distrib_optimizer.py``) only works for them:

1. ``state_dict`` reads the step from the inner state, ``steps = list(set(s["step"].item() for s in
   state.values())); assert len(steps) == 1``. Before the first step the state is empty, ``steps`` is ``[]`` and the
   assertion fails. Every ``torch_dist`` load makes that call on the fresh optimizer (``load_checkpoint`` ->
   ``generate_state_dict`` -> ``sharded_state_dict(is_loading=True)`` -> ``self.state_dict()``, the template the
   checkpoint is read into), so no checkpoint with optimizer state loads: slime's ``train.py --load`` of its own
   ``--save`` directory stops in the train actor's ``init``.
2. ``load_state_dict`` puts one tensor, ``torch.tensor(steps[0])``, into every param's state, and then the default
   ``dp_reshardable`` param state copies the load template's ``step`` tensors (a ``LocalNonpersistentObject``:
   the template's own, 0) into it: the resumed optimizer is back at step 0, and since torch's Adam adds 1 to each
   param's ``step`` in turn, the one shared counter then advances once per parameter shard at every step. Adam's
   bias corrections are wrong and the resumed job trains other weights than the uninterrupted one.
3. With ``--dist-ckpt-optim-fully-reshardable`` the loader leaves ``step`` out of each param's tensors (it comes
   from the param groups), and ``_set_main_param_and_optimizer_states`` copies every key of the live state:
   ``KeyError: 'step'``.

Here (only while ``HAVE_APEX_OR_TE`` is False; everything else is Megatron's own code): ``state_dict`` of a torch
optimizer that has not stepped reports step 0, what it has made (a temporary ``step`` 0 per param for the call, the
state put back after it); after ``load_state_dict`` every param's state holds a tensor of its own with the loaded
param groups' step, as the uninterrupted optimizer has; ``_set_main_param_and_optimizer_states`` given no ``step``
keeps the live one.

Upstream: patches/megatron/megatron-distrib-optimizer-torch-adam-step.md.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, method_mismatch, missing_attrs

MODULE = "megatron.core.optimizer.distrib_optimizer"
CLASS = "DistributedOptimizer"
FLAG = "HAVE_APEX_OR_TE"
STATE_DICT_SOURCE = ("inner_state_dict = self.optimizer.state_dict()", "if not HAVE_APEX_OR_TE:",
                     'steps = list(set([s["step"].item() for s in inner_state_dict["state"].values()]))',
                     "assert len(steps) == 1", 'param_group["step"] = step')
LOAD_STATE_DICT_SOURCE = ("if not HAVE_APEX_OR_TE:", "step = torch.tensor(steps[0], dtype=torch.float)",
                          's["step"] = step', "self.optimizer.load_state_dict(")
SET_STATES = "_set_main_param_and_optimizer_states"
SET_STATES_SOURCE = ("for k, v in optim_state.items():", "for key in dst_tensors:",
                     "dst_tensors[key].copy_(tensors[key])")


def wanted() -> bool:
    """The distributed optimizer wraps torch's Adam here (no TE / Apex FusedAdam): evaluated when Megatron's
    distrib_optimizer module has been imported."""
    module = sys.modules.get(MODULE)
    return module is not None and _torch_adam(module)


def _torch_adam(module: ModuleType) -> bool:
    return getattr(module, FLAG, True) is False


def unstepped(inner) -> bool:
    """Torch optimizer ``inner`` has made no step: no param's state holds a ``step`` (before the first step its
    lazy state does not exist; an entry without ``step`` is what a ``state[p]`` lookup of its defaultdict leaves)."""
    return not any("step" in state for state in inner.state.values())


def _state_dict(module: ModuleType):
    def wrap(original):
        def state_dict(self):
            inner = self.optimizer
            if not _torch_adam(module) or not unstepped(inner):
                return original(self)
            import torch

            # a torch Adam that has not stepped has made 0 steps, and its lazy state would start at 0: each param
            # gets a step 0 for this call (its entry, if any, kept and put back unchanged afterwards)
            params = [p for group in inner.param_groups for p in group["params"]]
            before = {p: inner.state[p] for p in params if p in inner.state}
            for p in params:
                inner.state[p] = {**before.get(p, {}), "step": torch.zeros((), dtype=torch.float32)}
            try:
                return original(self)
            finally:
                for p in params:
                    if p in before:
                        inner.state[p] = before[p]
                    else:
                        inner.state.pop(p, None)

        state_dict.__wrapped__ = original
        return state_dict

    return wrap


def loaded_step(state_dict: Any) -> float | None:
    """The step a state dict of the distributed optimizer carries (its param groups' ``step``, which Megatron's
    torch-Adam path writes into every group); None when it has none (Megatron-FSDP's, TE's)."""
    groups = state_dict.get("optimizer", {}).get("param_groups", []) if isinstance(state_dict, dict) else []
    steps = {g["step"] for g in groups if isinstance(g, dict) and g.get("step") is not None}
    if len(steps) != 1:
        return None
    return float(next(iter(steps)))


def set_steps(inner, step: float) -> int:
    """Give every state of torch optimizer ``inner`` that has a ``step`` a tensor of its own holding ``step``, as
    torch Adam's lazy state has one per param; returns how many were set."""
    import torch

    count = 0
    for state in inner.state.values():
        if "step" in state:
            old = state["step"]
            dtype = old.dtype if torch.is_tensor(old) else torch.float32
            device = old.device if torch.is_tensor(old) else None
            state["step"] = torch.tensor(step, dtype=dtype, device=device)
            count += 1
    return count


def _load_state_dict(module: ModuleType):
    def wrap(original):
        def load_state_dict(self, state_dict):
            result = original(self, state_dict)
            step = loaded_step(state_dict) if _torch_adam(module) else None
            if step is not None:
                # one counter per param (Megatron set one shared tensor), holding the loaded step: the dp_reshardable
                # param state copies the load template's step (0) into it after the param groups were read
                set_steps(self.optimizer, step)
            return result

        load_state_dict.__wrapped__ = original
        return load_state_dict

    return wrap


def _set_states(module: ModuleType):
    def wrap(original):
        def _set_main_param_and_optimizer_states(self, model_param, tensors):
            if _torch_adam(module) and isinstance(tensors, dict) and "step" not in tensors:
                group_index, group_order = self.model_param_group_index_map[model_param]
                main_param = self.optimizer.param_groups[group_index]["params"][group_order]
                live = self.optimizer.state.get(main_param, {}).get("step")
                if live is not None:
                    # the fully_reshardable and model-space loaders leave "step" out (it comes from the param
                    # groups), this copy wants every live state key: the live step, copied onto itself
                    tensors = {**tensors, "step": live}
            return original(self, model_param, tensors)

        _set_main_param_and_optimizer_states.__wrapped__ = original
        return _set_main_param_and_optimizer_states

    return wrap


class DistribOptimizerStep(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        module = modules[MODULE]
        problems = missing_attrs(module, [FLAG, CLASS])
        if problems:
            return problems
        return (method_mismatch(module, f"{CLASS}.state_dict", ["self"], STATE_DICT_SOURCE, unwrap=True)
                + method_mismatch(module, f"{CLASS}.load_state_dict", ["self", "state_dict"], LOAD_STATE_DICT_SOURCE,
                                  unwrap=True)
                + method_mismatch(module, f"{CLASS}.{SET_STATES}", ["self", "model_param", "tensors"],
                                  SET_STATES_SOURCE, unwrap=True))

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        module = modules[MODULE]
        cls = getattr(module, CLASS)
        self.wrap(cls, "state_dict", _state_dict(module))
        self.wrap(cls, "load_state_dict", _load_state_dict(module))
        self.wrap(cls, SET_STATES, _set_states(module))


PATCH = DistribOptimizerStep(
    id="train.distrib_optimizer_step",
    targets=(f"{MODULE}:{CLASS}.state_dict", f"{MODULE}:{CLASS}.load_state_dict", f"{MODULE}:{CLASS}.{SET_STATES}"),
    why="Without TransformerEngine or Apex (always on the host) Megatron's DistributedOptimizer wraps torch's "
    "Adam, whose step lives in each param's lazily created state: its state_dict asserts one step over that "
    "state, empty before the first step, so every torch_dist load (sharded_state_dict(is_loading=True) calls it "
    "on the fresh optimizer) fails with 'assert len(steps) == 1' and train.py --load of slime's own --save stops; "
    "past that, load_state_dict leaves every param one shared step tensor that the dp_reshardable param state "
    "resets to the template's 0 (and torch's Adam advances once per param), so the resumed job trains other "
    "weights than the uninterrupted one; and the fully_reshardable loader raises KeyError: 'step'.",
    how="Wrap DistributedOptimizer.state_dict: a torch optimizer that has not stepped gets a temporary step 0 per "
    "param for the call (its state put back after it), so it reports step 0; wrap load_state_dict: afterwards "
    "every param's state gets a tensor of its own holding the loaded param groups' step; wrap "
    "_set_main_param_and_optimizer_states: tensors without 'step' keep the live one. Only while "
    "distrib_optimizer.HAVE_APEX_OR_TE is False (predicate wanted(), when that module is imported).",
    upstream="patches/megatron/megatron-distrib-optimizer-torch-adam-step.md",
    checked_on=("0.3.1",),
)

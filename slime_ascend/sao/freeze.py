"""Frozen critic attention: the config check at start and the check on the real model.

slime applies ``freeze_params_name_list`` (regexes, ``re.search`` on parameter names) in its model
provider, before the optimizer is built, so a frozen parameter gets no gradient buffer and no
optimizer state. SAO freezes the critic's attention only, so the list must sit in the critic role of
``--megatron-config-path`` (``slime_ascend.sao.role_config.write_megatron_role_config``).

* :func:`check_freeze_config` (start, every train process): the critic entry of the megatron config
  (or this process's own args) carries the patterns.
* :func:`before_train_step` (slime's before-train-step hook): in the critic, at the first step,
  every parameter matching the patterns has ``requires_grad=False``, no ``main_grad`` buffer and no
  place in the optimizer; at the second step (after one optimizer update) they are bit-identical.
  In the actor, its own ``freeze_params_name_list`` must not hold the patterns (a global list).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .role_config import critic_overrides

__all__ = [
    "FrozenSnapshot",
    "before_train_step",
    "check_freeze_config",
    "matching_names",
    "verify_frozen",
]

PLUGIN_NAME = "sao"


def matching_names(names: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """Names that any pattern matches with ``re.search`` (slime's freeze rule)."""
    compiled = [re.compile(p) for p in patterns]
    return [n for n in names if any(c.search(n) for c in compiled)]


def _fix(patterns: Sequence[str]) -> str:
    return (
        "Fix: write the role config with `python -m slime_ascend.sao.critic -o sao_megatron.yaml` (or add "
        f"`freeze_params_name_list: {list(patterns)}` under the `role: critic` entry's overrides of your own file) "
        "and pass `--megatron-config-path sao_megatron.yaml`; or set ascend_sao_freeze_critic_attention: false"
    )


def check_freeze_config(args: Any, patterns: Sequence[str]) -> None:
    """Raise SettingsError unless the critic will be built with ``patterns`` frozen (see module doc)."""
    from slime_ascend.plugins.settings import SettingsError

    own = list(getattr(args, "freeze_params_name_list", None) or [])
    if all(p in own for p in patterns):
        return  # the critic's own args (or a global list, which the actor's step check rejects)
    path = getattr(args, "megatron_config_path", None)
    if path is None:
        raise SettingsError(
            "sao: ascend_sao_freeze_critic_attention is on but slime has no --megatron-config-path, so the critic "
            "cannot get its own freeze list. " + _fix(patterns)
        )
    try:
        overrides = critic_overrides(path)
    except FileNotFoundError:
        return  # not readable in this process; the critic's first train step checks the real model
    frozen = list(overrides.get("freeze_params_name_list") or [])
    missing = [p for p in patterns if p not in frozen]
    if missing:
        raise SettingsError(
            f"sao: the critic entry of --megatron-config-path {path} freezes {frozen}, missing {missing}. "
            + _fix(patterns)
        )


def _chunks(model: Any) -> list[Any]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _named_parameters(model: Any) -> list[tuple[str, torch.nn.Parameter]]:
    chunks = _chunks(model)
    return [((f"chunk{i}." if len(chunks) > 1 else "") + n, p) for i, chunk in enumerate(chunks)
            for n, p in chunk.named_parameters()]


def _optimizer_param_ids(optimizer: Any) -> set[int]:
    """ids of the parameters any (chained / wrapped) torch optimizer holds or keeps state for."""
    ids: set[int] = set()
    stack, seen = [optimizer], set()
    while stack:
        opt = stack.pop()
        if opt is None or id(opt) in seen:
            continue
        seen.add(id(opt))
        for group in getattr(opt, "param_groups", None) or []:
            ids.update(id(p) for p in group.get("params", []))
        state = getattr(opt, "state", None)
        if isinstance(state, dict):
            ids.update(id(k) for k in state if isinstance(k, torch.Tensor))
        chained = getattr(opt, "chained_optimizers", None)
        if isinstance(chained, (list, tuple)):
            # Megatron's ChainedOptimizer (an MoE model's dense and expert optimizers): its ``optimizer``
            # property asserts that it chains only one, so only the chained ones are read
            stack.extend(chained)
            continue
        inner = getattr(opt, "optimizer", None)
        if inner is not None and inner is not opt:
            stack.append(inner)
    return ids


def verify_frozen(model: Any, optimizer: Any, patterns: Sequence[str]) -> list[str]:
    """Check that the parameters ``patterns`` match are frozen; return their names (raises RuntimeError)."""
    named = _named_parameters(model)
    frozen = set(matching_names([n for n, _ in named], patterns))
    if not frozen:
        raise RuntimeError(
            f"sao: the freeze patterns {list(patterns)} match no parameter of the critic (names look like "
            f"{[n for n, _ in named[:3]]}). Fix: set ascend_sao_freeze_patterns to regexes of this model's attention "
            "parameter names (and the critic's freeze_params_name_list with them)"
        )
    in_optimizer = _optimizer_param_ids(optimizer)
    problems = []
    for name, p in named:
        if name not in frozen:
            continue
        if p.requires_grad:
            problems.append(f"{name}: requires_grad is True")
        if getattr(p, "main_grad", None) is not None:
            problems.append(f"{name}: has a main_grad buffer")
        if id(p) in in_optimizer:
            problems.append(f"{name}: is in the optimizer")
    if not any(p.requires_grad for n, p in named if n not in frozen):
        problems.append("no parameter outside the frozen set is trainable")
    if problems:
        raise RuntimeError(
            "sao: frozen critic attention is not in effect: " + "; ".join(problems[:8])
            + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else "") + ". " + _fix(patterns)
        )
    return sorted(frozen)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    int_type = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(int_type).to(torch.int64)


class FrozenSnapshot:
    """Bit-pattern checksums of named parameters (int64 sums of the raw bits and a position weighting)."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]):
        self.sums = {n: self._checksum(p) for n, p in named}

    @staticmethod
    def _checksum(p: torch.Tensor) -> tuple[int, int]:
        b = _bits(p).flatten()
        w = torch.arange(b.numel(), device=b.device, dtype=torch.int64) % 65521 + 1
        return int(b.sum()), int((b * w).sum())

    def changed(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        return [n for n, p in named if n in self.sums and self._checksum(p) != self.sums[n]]


_state: dict[int, dict[str, Any]] = {}


def before_train_step(args: Any, rollout_id: int, step_id: int, model: Any, optimizer: Any,
                      opt_param_scheduler: Any) -> None:
    """slime before-train-step hook: freeze checks in the critic (steps 1 and 2), leak check in the actor."""
    from slime_ascend.plugins import runtime

    settings = runtime.settings(args, PLUGIN_NAME)
    if not (settings.freeze_critic_attention and settings.verify_frozen):
        return
    first = _chunks(model)[0]
    st = _state.setdefault(id(first), {"calls": 0})
    st["calls"] += 1
    if st["calls"] > 2:
        return
    patterns = list(settings.freeze_patterns)
    if getattr(first, "role", None) != "critic":
        own = list(getattr(args, "freeze_params_name_list", None) or [])
        if st["calls"] == 1 and all(p in own for p in patterns):
            raise RuntimeError(
                f"sao: the actor freezes {patterns} too: the freeze list is global. Fix: remove "
                "--freeze-params-name-list from the command line; keep it only in the critic role of "
                "--megatron-config-path"
            )
        return
    if st["calls"] == 1:
        names = set(verify_frozen(model, optimizer, patterns))
        st["snapshot"] = FrozenSnapshot((n, p) for n, p in _named_parameters(model) if n in names)
        return
    changed = st.pop("snapshot").changed(_named_parameters(model))
    if changed:
        raise RuntimeError(f"sao: frozen critic parameters changed after an optimizer step: {changed[:5]}")

"""The few slime train-side library functions our plugins call, for the demo's trainer.

Plugin losses (e.g. ``slime_ascend.sao.loss.sao_loss``) take slime's packed ``logits [1, T, V]`` and
extract per-sample response log-probs / values with slime's
``slime.backends.megatron_utils.loss.get_log_probs_and_entropy`` / ``get_values``. Where slime is
importable the demo uses slime's own functions (with a single-process Megatron parallel state).
Where it is not (a fresh machine), :func:`install` registers this module's stand-ins under those
names, with slime's signatures and its context-parallel-size-1 semantics, so the very same plugin
code runs. They are deliberately minimal: no tensor/context parallelism, no top-p replay.

:func:`sum_of_sample_mean` mirrors ``slime.backends.megatron_utils.cp_utils.get_sum_of_sample_mean``
(CP size 1) and is what the demo's trainer hands to the loss hook.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["install", "slime_importable", "sum_of_sample_mean", "get_log_probs_and_entropy", "get_values"]

LOSS_MODULE = "slime.backends.megatron_utils.loss"
_installed = False


def slime_importable() -> bool:
    """True when the real slime package (not our stand-in) and the Megatron its train side runs on can be
    imported (a slime tree on PYTHONPATH without its dependencies gets the stand-in)."""
    mod = sys.modules.get("slime")
    if mod is not None:
        return not getattr(mod, "__slime_ascend_standin__", False)
    from ..host import module_installed

    return module_installed("slime") and module_installed("megatron")


def _responses(logits: torch.Tensor, args: Any, unconcat_tokens: Sequence[torch.Tensor],
               total_lengths: Sequence[int], response_lengths: Sequence[int],
               apply_temperature: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """slime ``get_responses`` for CP size 1: response-aligned (logits chunk, tokens chunk) per sample."""
    if logits.dim() != 3 or logits.size(0) != 1:
        raise ValueError(f"logits must be [1, T, V], got {tuple(logits.shape)}")
    logits = logits.squeeze(0)
    temperature = float(getattr(args, "rollout_temperature", 1.0) or 1.0)
    if apply_temperature and temperature != 1.0:
        logits = logits / temperature
    end = 0
    for tokens, total, resp in zip(unconcat_tokens, total_lengths, response_lengths, strict=True):
        end += int(total)
        start = end - int(resp)
        yield logits[start - 1 : end - 1], tokens[-int(resp):] if resp else tokens[:0]


def get_log_probs_and_entropy(logits: torch.Tensor, *, args: Any, unconcat_tokens: list[torch.Tensor],
                              total_lengths: list[int], response_lengths: list[int], with_entropy: bool = False,
                              non_loss_data: bool = True, **_: Any) -> tuple[torch.Tensor, dict[str, list]]:
    """Per-token response log-probs (and entropy) as slime returns them: ``(empty, {"log_probs": [...]})``."""
    if logits.dtype != torch.float32:
        raise TypeError(f"logits must be float32 (slime's contract), got {logits.dtype}")
    log_probs, entropy = [], []
    for chunk, toks in _responses(logits, args, unconcat_tokens, total_lengths, response_lengths, True):
        lp = torch.log_softmax(chunk, dim=-1)
        log_probs.append(lp.gather(-1, toks.to(lp.device).long().unsqueeze(-1)).squeeze(-1))
        if with_entropy:
            entropy.append(-(lp.exp() * lp).sum(-1))
    res: dict[str, list] = {"log_probs": log_probs}
    if with_entropy:
        res["entropy"] = entropy
    return torch.empty((0,), device=logits.device), res


def get_values(logits: torch.Tensor, *, args: Any, unconcat_tokens: list[torch.Tensor], total_lengths: list[int],
               response_lengths: list[int], with_entropy: bool = False, non_loss_data: bool = True,
               **_: Any) -> tuple[torch.Tensor, dict[str, list]]:
    """Response-aligned values from a value head's ``[1, T, 1]`` output: ``(empty, {"values": [...]})``."""
    values = []
    for chunk, _toks in _responses(logits, args, unconcat_tokens, total_lengths, response_lengths, False):
        if chunk.size(-1) != 1:
            raise ValueError(f"value logits must end in a size-1 dimension, got {tuple(chunk.shape)}")
        values.append(chunk.squeeze(-1))
    return torch.empty((0,), device=logits.device), {"values": values}


def sum_of_sample_mean(response_lengths: Sequence[int], loss_masks: Sequence[torch.Tensor],
                       sample_denoms: Sequence[float] | None = None,
                       calculate_per_token_loss: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """slime's reducer for CP size 1: per-token sum, or the sum of per-sample (per-rollout) means."""
    masks = [m.float() for m in loss_masks]
    denoms = [m.sum() for m in masks] if sample_denoms is None else [torch.as_tensor(float(d)) for d in sample_denoms]
    lengths = [int(r) for r in response_lengths]

    def reduce(x: torch.Tensor) -> torch.Tensor:
        parts = x.split(lengths, dim=0)
        if calculate_per_token_loss:
            return sum((p * m.to(p.device)).sum() for p, m in zip(parts, masks, strict=True))
        return sum((p * m.to(p.device)).sum() / torch.clamp_min(d, 1) for p, m, d in zip(parts, masks, denoms,
                                                                                          strict=True))

    return reduce


def _standin(name: str, is_package: bool = False, **attrs: Any) -> types.ModuleType:
    """A stand-in module ``name`` holding ``attrs``, marked as ours."""
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=is_package)
    if is_package:
        mod.__path__ = []  # a package with no files: other submodules stay unimportable
    mod.__slime_ascend_standin__ = True
    mod.__dict__.update(attrs)
    return mod


def install() -> str:
    """Make ``slime.backends.megatron_utils.loss`` (and ``megatron.core.mpu``) importable in this process.

    Returns ``"slime"`` when the real slime is used, ``"standin"`` when the stand-ins were registered.
    Only the demo's trainer process calls this.
    """
    global _installed
    if _installed:
        return "standin"
    if slime_importable():
        _init_megatron_single_process()
        return "slime"
    for name in ("slime", "slime.backends", "slime.backends.megatron_utils"):
        sys.modules.setdefault(name, _standin(name, is_package=True))
    loss = _standin(LOSS_MODULE, get_log_probs_and_entropy=get_log_probs_and_entropy, get_values=get_values)
    sys.modules[LOSS_MODULE] = loss
    sys.modules["slime.backends.megatron_utils"].loss = loss
    if importlib.util.find_spec("megatron") is not None:
        _init_megatron_single_process()  # an uninitialised Megatron reports CP world size 0
    else:
        for name in ("megatron", "megatron.core"):
            sys.modules.setdefault(name, _standin(name, is_package=True))
        # megatron.core.mpu of one process with no model parallelism
        mpu = _standin("megatron.core.mpu", get_context_parallel_rank=lambda: 0,
                       get_context_parallel_world_size=lambda: 1, get_tensor_model_parallel_world_size=lambda: 1,
                       model_parallel_is_initialized=lambda: False)
        sys.modules["megatron.core.mpu"] = mpu
        sys.modules["megatron.core"].mpu = mpu
    _installed = True
    return "standin"


def _init_megatron_single_process() -> None:
    """A one-rank gloo group and Megatron's parallel state (TP = PP = CP = 1), as slime's CPU tests do."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            from .slime_job import free_port

            os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)

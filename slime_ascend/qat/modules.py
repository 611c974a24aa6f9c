"""QAT in slime's train actor: Megatron's linear weights fake-quantised in every forward, straight-through backward.

The seam: a forward pre-hook and an always-called forward hook on each Megatron module that owns a quantised
weight (``ColumnParallelLinear`` / ``RowParallelLinear``, the cpu spec's norm-fused and grouped expert linears, TE's
linears: any module whose forward reads its own ``weight`` / ``weight{i}``). The pre-hook puts
``FakeQuant(weight)`` in the module's parameter slot for the length of its forward and the forward hook puts the
parameter back: the module computes with the fake-quantised weight, autograd carries the gradient through the
straight-through estimator to the floating master parameter (Megatron's DDP sees its own parameter's gradient), and
every other reader (optimizer, checkpointing, the weight sync) only ever sees the parameter. Hooks are registered on
the module instances slime built; no Megatron class is changed.

Which weights: exactly the ones the weight-sync funnel quantises. Each parameter is named as slime's sync names it
(``named_params_and_buffers``, global layer and expert numbers), converted to its HF names by slime's own
``megatron_to_hf`` converter (on a meta tensor of the TP-gathered shape: names only), and fake-quantised when the
spec's name policy (:func:`slime_ascend.quant.name_policy.should_quantize`, the exporter's) quantises its HF tensors;
router, norms, embeddings, ``lm_head``, biases stay floating. A Megatron weight whose HF tensors the policy splits
(some quantised, some not) is refused.

Why the fake quant equals the exporter's on the HF tensors: the converters take rows of the Megatron weight (the
q/k/v split of Megatron's interleaved ``linear_qkv``, gate/up of ``linear_fc1``) and keep its input dim; INT4 groups
and INT8 channels are per row along the input dim, so quantising the Megatron weight row by row is quantising each HF
tensor. FP8 blocks span rows, so in fp8-block mode each HF tensor's rows (found by running the converter on a tensor
of row numbers) are fake-quantised as that tensor and written back to their rows. On a TP shard the rows are whole
and the input dim is cut at group boundaries (``spec.check_layout``), so the shard's fake quant is the slice of the
gathered weight's.

Installed by the ``before_log_prob`` and ``before_train_step`` contributions (slime calls them with the model before
every forward-only pass and every train step: RL's log-prob passes and the policy/SFT steps all run fake-quantised);
the first call per model chunk installs, later calls find it installed.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..plugins.settings import SettingsError
from ..quant.fake_quant import fake_quantize_values
from ..quant.name_policy import should_quantize
from ..quant.schemes import FP8_BLOCK, QuantSpec

logger = logging.getLogger("slime_ascend.qat")


class StraightThrough(torch.autograd.Function):
    """``values(weight)`` forward, identity backward (the QAT straight-through estimator)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, values: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return values(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def fake_quantize_rows(weight: torch.Tensor, spec: QuantSpec, rows: Sequence[torch.Tensor] | None) -> torch.Tensor:
    """``weight`` fake-quantised as the exporter quantises its HF tensors: ``rows[i]`` are the rows of HF tensor i
    (None: a per-row scheme, the whole weight at once). No autograd."""
    if rows is None:
        return fake_quantize_values(weight, spec)
    with torch.no_grad():
        out = torch.empty_like(weight)
        for r in rows:
            out[r] = fake_quantize_values(weight[r], spec)
        return out


@dataclass(frozen=True)
class QuantizedWeight:
    """One fake-quantised Megatron weight: slime's global name, its HF names, and (fp8-block) each HF tensor's rows."""

    name: str
    hf_names: tuple[str, ...]
    rows: tuple[torch.Tensor, ...] | None = None


class FakeQuantHooks:
    """The pre/post forward hooks of one module: ``plan`` maps its parameter attributes to their weights."""

    def __init__(self, module: torch.nn.Module, plan: dict[str, QuantizedWeight], spec: QuantSpec):
        self.plan, self.spec = plan, spec
        self.module_ref = weakref.ref(module)
        self.stash: dict[str, torch.nn.Parameter] = {}
        self.handles = (module.register_forward_pre_hook(self.pre),
                        module.register_forward_hook(self.post, always_call=True))

    def fake(self, attr: str, weight: torch.Tensor) -> torch.Tensor:
        entry = self.plan[attr]
        return StraightThrough.apply(weight, lambda w: fake_quantize_rows(w, self.spec, entry.rows))

    def pre(self, module: torch.nn.Module, _inputs: Any) -> None:
        if self.stash:
            raise RuntimeError(f"qat: {type(module).__name__} entered its forward again before it returned "
                               f"({', '.join(e.name for e in self.plan.values())})")
        for attr in self.plan:
            param = module._parameters[attr]
            self.stash[attr] = param
            module._parameters[attr] = self.fake(attr, param)

    def post(self, module: torch.nn.Module, _inputs: Any, _output: Any) -> None:
        for attr, param in self.stash.items():
            module._parameters[attr] = param
        self.stash.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# ------------------------------------------------------------------------------------------- names
def hf_tensors(args: Any, model_name: str, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """slime's own Megatron -> HF conversion of one (gathered-shape) weight, without the quantizer funnel and
    without leaving anything in the converter's MLA pairing cache (what it parks there is this weight's)."""
    from slime.backends.megatron_utils import megatron_to_hf

    cache = megatron_to_hf._cached_tensors
    before = set(cache)
    out = list(megatron_to_hf._convert_to_hf_core(args, model_name, name, tensor))
    parked = [(k, cache.pop(k)) for k in [k for k in cache if k not in before]]
    return [(n, t) for n, t in out if n not in before] + parked


def gathered_shape(name: str, param: torch.Tensor) -> tuple[int, ...]:
    """The shape slime's ``all_gather_param`` gives ``param`` (its tensor-parallel dim times the TP size)."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False) and getattr(param, "parallel_mode", None) != "duplicated":
        from megatron.core import mpu

        tp = (mpu.get_expert_tensor_parallel_world_size() if ".experts." in name
              else mpu.get_tensor_model_parallel_world_size())
        shape[param.partition_dim] *= tp
    return tuple(shape)


def row_maps(args: Any, model_name: str, name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Each HF tensor's rows of a Megatron weight of ``shape`` (its converter run on a tensor of row numbers);
    a converter output that is not a choice of whole rows is refused."""
    n, k = shape
    index = torch.arange(n, dtype=torch.int32).unsqueeze(1).expand(n, k).contiguous()
    rows = []
    for hf_name, t in hf_tensors(args, model_name, name, index):
        if t.dim() != 2 or t.shape[1] != k or not bool((t == t[:, :1]).all()):
            raise SettingsError(f"qat: slime's converter does not take whole rows of {name} for {hf_name}, so "
                                f"fp8-block fake quant cannot follow the exporter's blocks. Fix: int4-group QAT")
        rows.append(t[:, 0].long())
    return tuple(rows)


def plan_weights(args: Any, model: Sequence[torch.nn.Module], spec: QuantSpec, model_name: str,
                 named: Sequence[tuple[str, torch.Tensor]] | None = None
                 ) -> dict[int, tuple[torch.nn.Module, dict[str, QuantizedWeight]]]:
    """``{id(module): (module, {attr: QuantizedWeight})}`` for every weight of ``model`` (slime's model chunks) the
    spec's name policy quantises. ``named``: slime's global names of the parameters (default: slime's
    ``named_params_and_buffers``, the names its weight sync converts)."""
    if named is None:
        from slime.backends.megatron_utils.update_weight.common import named_params_and_buffers

        named = list(named_params_and_buffers(args, model, convert_to_global_name=True))
    owners: dict[int, tuple[torch.nn.Module, str]] = {}
    for chunk in model:
        for module in chunk.modules():
            for attr, param in module._parameters.items():
                if param is not None:
                    owners[id(param)] = (module, attr)
    group = spec.int_scheme.group_size if spec.int_scheme is not None else None
    plan: dict[int, tuple[torch.nn.Module, dict[str, QuantizedWeight]]] = {}
    for name, param in named:
        if param.dim() != 2 or id(param) not in owners:
            continue
        shape = gathered_shape(name, param)
        hf = hf_tensors(args, model_name, name, torch.empty(shape, dtype=param.dtype, device="meta"))
        wanted = [should_quantize(n, t.dim(), spec.ignore, spec.extra_ignore) for n, t in hf]
        if not any(wanted):
            continue
        if not all(wanted):
            raise SettingsError(f"qat: {name} holds HF tensors the {spec.fmt} name policy quantises and others it "
                                f"keeps ({', '.join(n for n, _ in hf)}): one fake quant cannot cover both. Fix: "
                                f"quantise or ignore all of them in --hf-checkpoint's quantization config")
        if group and param.shape[-1] % group:
            raise SettingsError(f"qat: {name}: this rank's input dim {param.shape[-1]} is not a multiple of the "
                                f"group size {group}. Fix: a parallel layout that keeps it whole in groups")
        rows = row_maps(args, model_name, name, shape) if spec.fmt == FP8_BLOCK else None
        module, attr = owners[id(param)]
        plan.setdefault(id(module), (module, {}))[1][attr] = QuantizedWeight(name, tuple(n for n, _ in hf), rows)
    return plan


# ------------------------------------------------------------------------------------------- install
_installed: "weakref.WeakKeyDictionary[torch.nn.Module, list[FakeQuantHooks]]" = weakref.WeakKeyDictionary()


def install(args: Any, model: Sequence[torch.nn.Module], spec: QuantSpec, model_name: str,
            named: Sequence[tuple[str, torch.Tensor]] | None = None) -> list[FakeQuantHooks]:
    """Hook every quantised weight of ``model``'s chunks (once per chunk); returns the hooks of this call's chunks."""
    if all(chunk in _installed for chunk in model):
        return [h for chunk in model for h in _installed[chunk]]
    plan = plan_weights(args, model, spec, model_name, named)
    hooks = [FakeQuantHooks(module, attrs, spec) for module, attrs in plan.values()]
    for chunk in model:
        mine = {id(m) for m in chunk.modules()}
        _installed[chunk] = [h for h, (module, _) in zip(hooks, plan.values()) if id(module) in mine]
    count = sum(len(attrs) for _, attrs in plan.values())
    scheme = spec.int_scheme
    logger.info("qat: fake-quantising %d weights in %s%s (straight-through backward)", count, spec.fmt,
                f", groups of {scheme.group_size}" if scheme is not None and scheme.group_size else "")
    return hooks


def model_name_of(args: Any) -> str:
    """The model name slime's train actor gives its converters (``--model-name``, else the HF config class)."""
    if getattr(args, "model_name", None):
        return args.model_name
    from transformers import AutoConfig

    return type(AutoConfig.from_pretrained(args.hf_checkpoint, trust_remote_code=True)).__name__.lower()


def _install_for(args: Any, model: Sequence[torch.nn.Module]) -> None:
    from ..plugins import runtime
    from .spec import resolve_spec

    if all(chunk in _installed for chunk in model):
        return
    install(args, model, resolve_spec(args, runtime.settings(args, "qat")), model_name_of(args))


def before_log_prob(args: Any, model: Sequence[torch.nn.Module], store_prefix: str) -> None:
    """``before_log_prob`` contribution: the forward-only passes (old, ref and teacher log-probs) run fake-quantised."""
    _install_for(args, model)


def before_train_step(args: Any, rollout_id: int, step_id: int, model: Sequence[torch.nn.Module], optimizer: Any,
                      opt_param_scheduler: Any) -> None:
    """``before_train_step`` contribution: every train step (RL and ``--loss-type sft_loss``) runs fake-quantised."""
    _install_for(args, model)

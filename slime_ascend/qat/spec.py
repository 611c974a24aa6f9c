"""Which quantiser ``qat`` fake-quantises with, and the layouts it refuses (checked in the driver's ``parse_args``).

One quantiser: with a sync plugin on (``int4-sync``, ``fp8-sync``, ``int8-sync``) the spec is the one that plugin
pushes (:func:`slime_ascend.weight_sync.funnel.checkpoint_spec`: ``--hf-checkpoint``'s group size, symmetry and
ignore rules, the plugin's numerics), so the trainer's fake quant and the engine's weights come from one
``QuantSpec``; without one it is ``make_spec`` of the settings, the spec ``slime-ascend quantize --format F
--group-size G`` uses. Settings that contradict the sync's spec are refused, not overridden.
"""

from __future__ import annotations

from typing import Any

from ..plugins.settings import SettingsError
from ..quant.schemes import FP8_BLOCK, INT4_GROUP, INT8_CT, INT8_W8A8, QuantSpec, make_spec

FORMATS = (INT4_GROUP, FP8_BLOCK, INT8_CT, INT8_W8A8)
DEFAULT_GROUP_SIZE = 128  # `slime-ascend quantize --group-size`'s default


def resolve_spec(args: Any, settings: Any) -> QuantSpec:
    """The spec of this job's fake quant (module doc); ``settings``: the ``qat`` plugin's view."""
    from ..plugins import registry, runtime
    from ..weight_sync import funnel
    from ..weight_sync.plugin import NAMES

    fmt, group, numerics = settings["ascend_qat_format"], settings["ascend_qat_group_size"], settings[
        "ascend_qat_numerics"]
    plugin = next((n for n in runtime.enabled_names(args) if n in NAMES), None)
    sync_numerics = "compressed-tensors"
    if plugin == "int4-sync":
        sync_numerics = runtime.settings_values(registry.available()[plugin], args)["ascend_int4_sync_numerics"]
    pushed = funnel.checkpoint_spec(args, plugin, sync_numerics)
    if pushed is None:
        return make_spec(fmt, group_size=group or DEFAULT_GROUP_SIZE, numerics=numerics or "compressed-tensors")
    if pushed.fmt != fmt:
        raise SettingsError(f"qat: ascend_qat_format is {fmt} but {plugin} pushes {pushed.fmt} (--hf-checkpoint "
                            f"{args.hf_checkpoint}); the engine would serve another quantiser than the one trained "
                            f"with. Fix: set ascend_qat_format: {pushed.fmt}")
    scheme = pushed.int_scheme
    if group is not None and scheme is not None and scheme.group_size != group:
        raise SettingsError(f"qat: ascend_qat_group_size {group} but {plugin} pushes groups of {scheme.group_size} "
                            f"(--hf-checkpoint {args.hf_checkpoint}). Fix: drop ascend_qat_group_size (the pushed "
                            f"group size is used) or quantise the checkpoint with --group-size {group}")
    if numerics is not None and pushed.fmt == INT4_GROUP and pushed.int4_numerics != numerics:
        raise SettingsError(f"qat: ascend_qat_numerics {numerics} but {plugin} pushes {pushed.int4_numerics} "
                            f"numerics. Fix: drop ascend_qat_numerics (int4-sync's is used) or set "
                            f"ascend_int4_sync_numerics: {numerics}")
    return pushed


def _size(args: Any, key: str, default: int = 1) -> int:
    value = getattr(args, key, None)
    return int(value) if value else default


def sharded_inputs(args: Any) -> list[tuple[str, int, int]]:
    """``(linear, full input dim, its shard's input dim)`` of the linears whose input dim Megatron splits
    (row-parallel: the attention output projection, the MLP's and the experts' ``linear_fc2``) plus the
    column-parallel ones' whole input (the hidden size), from slime's Megatron args."""
    tp = _size(args, "tensor_model_parallel_size")
    etp = _size(args, "expert_tensor_parallel_size", tp)
    hidden = _size(args, "hidden_size", 0)
    out = [("column-parallel linears (hidden size)", hidden, hidden)] if hidden else []
    heads, channels = _size(args, "num_attention_heads", 0), getattr(args, "kv_channels", None)
    v_dim = getattr(args, "v_head_dim", None) if getattr(args, "multi_latent_attention", False) else None
    if heads:
        width = heads * int(v_dim or channels or (hidden // heads if hidden else 0))
        out.append(("self_attention.linear_proj", width, width // tp))
    experts = getattr(args, "num_experts", None)
    freq = getattr(args, "moe_layer_freq", 1)
    all_moe = bool(experts) and (freq == 1 or (isinstance(freq, (list, tuple)) and all(freq)))
    ffn = _size(args, "ffn_hidden_size", 0)
    if ffn and not all_moe:
        out.append(("mlp.linear_fc2", ffn, ffn // tp))
    if experts:
        moe_ffn = _size(args, "moe_ffn_hidden_size", ffn)
        out.append(("mlp.experts.linear_fc2", moe_ffn, moe_ffn // etp))
        shared = getattr(args, "moe_shared_expert_intermediate_size", None)
        if shared:
            out.append(("mlp.shared_experts.linear_fc2", int(shared), int(shared) // tp))
    return out


def check_layout(args: Any, spec: QuantSpec) -> None:
    """Refuse, in one line, a layout whose shards would not hold whole quantisation groups (fake quant on a shard
    must equal the exporter's on the gathered weight: per-row schemes always do; an int4 group must not straddle
    two tensor-parallel shards); FP8 blocks are 2-D, so fp8-block QAT runs at TP 1 and expert TP 1."""
    tp = _size(args, "tensor_model_parallel_size")
    etp = _size(args, "expert_tensor_parallel_size", tp)
    if spec.fmt == FP8_BLOCK and (tp > 1 or etp > 1):
        raise SettingsError(f"qat: fp8-block fake quant is supported at tensor and expert-tensor parallel size 1 "
                            f"(got {tp} / {etp}): its 128x128 blocks span Megatron's interleaved qkv and gate/up "
                            f"rows across shards. Fix: --tensor-model-parallel-size 1, or int4-group QAT")
    group = spec.int_scheme.group_size if spec.int_scheme is not None else None
    if not group:
        return
    for linear, full, shard in sharded_inputs(args):
        if shard % group:
            what = f"its TP shard's input dim {shard} (= {full} / TP)" if shard != full else f"its input dim {full}"
            raise SettingsError(f"qat: {linear}: {what} is not a multiple of the int4 group size {group}, so a group "
                                f"would straddle two shards and the fake quant would differ from the pushed "
                                f"weights. Fix: a --tensor-model-parallel-size that keeps {full} / TP a multiple of "
                                f"{group}, or a group size that divides {shard}")


def validate(args: Any, settings: Any) -> None:
    """The ``qat`` plugin's start-up check (every role, the driver's ``parse_args`` first)."""
    if getattr(args, "gradient_accumulation_fusion", False):
        raise SettingsError("qat: Megatron's gradient-accumulation fusion writes the weight gradient into "
                            "weight.main_grad inside the linear, which bypasses the fake quant's straight-through "
                            "backward. Fix: pass --no-gradient-accumulation-fusion")
    check_layout(args, resolve_spec(args, settings))

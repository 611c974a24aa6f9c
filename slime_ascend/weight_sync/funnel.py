"""Our contribution to slime's quantizer funnel, and the sync plugins' megatron-init step.

slime converts every Megatron parameter to HF tensors and hands them to ``quantize_params``
(``megatron_to_hf/processors``) on every transport. With ``train.quantize_params`` installed, our
dispatcher runs first and lands in :func:`quantize_params`, which returns the rollout
checkpoint's format (same function, names and name policy as the offline converter, so the bytes
are identical) or None for configs that are not the enabled plugin's, letting slime's own
quantizer run.

Which config: the one slime passes (``--hf-checkpoint``'s ``config.json`` ``quantization_config``).
When slime passes None, the Ascend msModelSlim description (``quant_model_description.json`` in
``--hf-checkpoint``) is used if the enabled plugin syncs one of its formats (``int8-sync``'s W8A8,
``mxfp8-sync``): msModelSlim removes ``quantization_config`` from config.json, so slime never sees it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..plugins import runtime
from ..plugins.settings import SettingsError
from ..quant.hf_config import format_from_quantization_config, read_checkpoint_quant_config, spec_from_quantization_config
from ..quant.names import MXFP8
from ..quant.schemes import FP8_BLOCK, INT4_GROUP, INT8_CT, INT8_W8A8, QuantSpec
from . import metrics
from .engine_gate import source_config
from .plugin import NAMES

logger = logging.getLogger("slime_ascend.weight_sync")

PLUGIN_FORMATS: dict[str, tuple[str, ...]] = {
    "fp8-sync": (FP8_BLOCK,),
    "int8-sync": (INT8_W8A8, INT8_CT),
    "int4-sync": (INT4_GROUP,),
    "mxfp8-sync": (MXFP8,),
}
DESCRIPTION_FORMATS = (INT8_W8A8, MXFP8)  # described by msModelSlim's quant_model_description.json, not config.json
ENGINE_POST_PROCESS_FORMATS = (INT8_W8A8,)  # formats slime's gate misses but whose engine layout differs


# ---------------------------------------------------------------------------------------------- plugin
def sync_plugin(args: Any) -> str | None:
    """The enabled sync plugin (at most one: they conflict), or None."""
    names = [n for n in runtime.active(args).selection.names if n in NAMES]
    return names[0] if names else None


def _numerics(args: Any, plugin: str) -> str:
    return runtime.settings(args, plugin).numerics if plugin == "int4-sync" else "compressed-tensors"


@dataclass(frozen=True)
class CheckpointFormat:
    path: str
    config: dict[str, Any] | None  # quantization_config, or the Ascend description
    fmt: str | None  # one of FORMATS, or None (unquantised / not ours)


_ckpt_lock = threading.Lock()
_ckpt_cache: dict[str, CheckpointFormat] = {}


def checkpoint_format(args: Any) -> CheckpointFormat:
    """The quantisation format of ``args.hf_checkpoint`` (read once per process and path)."""
    path = getattr(args, "hf_checkpoint", None)
    if not path:
        raise SettingsError("weight-sync plugins need --hf-checkpoint (the rollout engine's checkpoint)")
    path = os.fspath(path)
    with _ckpt_lock:
        cached = _ckpt_cache.get(path)
    if cached is not None:
        return cached
    config = read_checkpoint_quant_config(path) if os.path.isdir(path) else None
    result = CheckpointFormat(path, config, format_from_quantization_config(config))
    with _ckpt_lock:
        _ckpt_cache[path] = result
    return result


def clear_caches() -> None:
    with _ckpt_lock:
        _ckpt_cache.clear()
        _spec_cache.clear()


# ---------------------------------------------------------------------------------------------- specs
_spec_cache: dict[tuple[int, str], tuple[Any, QuantSpec | None]] = {}


def _spec_of(cfg: Mapping[str, Any], numerics: str) -> QuantSpec | None:
    key = (id(cfg), numerics)
    hit = _spec_cache.get(key)
    if hit is not None and hit[0] is cfg:
        return hit[1]
    spec = None if cfg.get("scale_fmt") not in (None, "fp32", "float32") else spec_from_quantization_config(cfg, numerics)
    if len(_spec_cache) > 64:
        _spec_cache.clear()
    _spec_cache[key] = (cfg, spec)
    return spec


def spec_for(args: Any, quantization_config: Mapping[str, Any] | None) -> QuantSpec | None:
    """Our spec for this call of the funnel, or None when the config is not the plugin's format."""
    plugin = sync_plugin(args)
    if plugin is None:
        return None
    cfg = source_config(quantization_config)
    if cfg is None:
        ckpt = checkpoint_format(args)
        if ckpt.fmt not in DESCRIPTION_FORMATS or ckpt.fmt not in PLUGIN_FORMATS[plugin]:
            return None
        cfg = ckpt.config
    spec = _spec_of(cfg, _numerics(args, plugin))
    if spec is None or spec.fmt not in PLUGIN_FORMATS[plugin]:
        return None
    return spec


def checkpoint_spec(args: Any, plugin: str | None, numerics: str = "compressed-tensors") -> QuantSpec | None:
    """The spec sync plugin ``plugin`` (None: none enabled) pushes for ``--hf-checkpoint``'s format (its group size,
    symmetry, ignore rules; ``numerics``: int4-sync's setting), or None: no sync plugin, no checkpoint directory, or a
    format that is not the plugin's. The ``qat`` plugin fake-quantises with this spec, so training and the push share
    one quantiser. (Arguments, not :func:`sync_plugin`: it runs inside the plugins' own validation.)"""
    path = getattr(args, "hf_checkpoint", None)
    if plugin is None or not path or not os.path.isdir(path):
        return None
    ckpt = checkpoint_format(args)
    if ckpt.config is None or ckpt.fmt not in PLUGIN_FORMATS[plugin]:
        return None
    spec = _spec_of(ckpt.config, numerics if plugin == "int4-sync" else "compressed-tensors")
    return spec if spec is not None and spec.fmt in PLUGIN_FORMATS[plugin] else None


# ---------------------------------------------------------------------------------------------- funnel
def _synchronize(tensors: list[Any]) -> None:
    """Wait for the device of the first device tensor: its device module's ``synchronize`` (``torch.cuda``,
    ``torch.npu``), else ``torch.accelerator``'s (a Python-registered backend such as the emulated npu has no
    device-wide synchronize behind ``torch.accelerator``: it raises there)."""
    for t in tensors:
        if getattr(t, "device", None) is not None and t.device.type != "cpu":
            import torch

            module = getattr(torch, t.device.type, None)
            if module is not None and hasattr(module, "synchronize"):
                module.synchronize(t.device)
            else:
                torch.accelerator.synchronize(t.device)
            return


def quantize_params(args, megatron_name, converted_named_params, quantization_config, transform_ue8m0=True):
    """The ``quantize_params`` contribution: our format's tensors, or None (not ours)."""
    spec = spec_for(args, quantization_config)
    if spec is None:
        return None
    from ..quant.params import quantize_named_params

    settings = runtime.settings(args, sync_plugin(args))
    named = list(converted_named_params)
    exact = settings.exact_timing
    if exact:
        _synchronize([t for _, t in named])
    start = time.perf_counter()
    out = quantize_named_params(named, spec)
    if exact:
        _synchronize([t for _, t in out])
    seconds = time.perf_counter() - start
    if settings.metrics:
        bytes_in = sum(t.numel() * t.element_size() for _, t in named)
        bytes_out = sum(t.numel() * t.element_size() for _, t in out)
        passed = {id(t) for _, t in named}
        quantized = len(named) - sum(1 for _, t in out if id(t) in passed)
        metrics.record_quantization(bytes_in, bytes_out, seconds, quantized)
    return out


# ---------------------------------------------------------------------------------------------- init
def check_engine_format(args: Any, plugin: str, settings: Any = None) -> CheckpointFormat:
    """Fail clearly unless ``--hf-checkpoint`` holds a format of ``plugin`` (``settings``: the plugin's view,
    default the validated one)."""
    ckpt = checkpoint_format(args)
    allowed = PLUGIN_FORMATS[plugin]
    prefix = "ascend_" + plugin.replace("-", "_") + "_"
    wanted = allowed[0]
    if plugin == "int8-sync":
        choice = (runtime.settings(args, plugin) if settings is None else settings)["ascend_int8_sync_format"]
        if choice != "auto":
            allowed = (choice,)
            wanted = choice
    cfg = ckpt.config or {}
    if cfg.get("scale_fmt") not in (None, "fp32", "float32"):
        raise SettingsError(
            f"plugin {plugin!r}: --hf-checkpoint {ckpt.path} uses FP8 scale_fmt={cfg.get('scale_fmt')!r}, which our "
            f"converter does not produce. Fix: convert the BF16 model with `slime-ascend quantize HF_DIR OUT_DIR "
            f"--format fp8-block` and pass OUT_DIR as --hf-checkpoint, or disable the plugin (slime's own FP8 path)."
        )
    if ckpt.fmt not in allowed:
        what = ckpt.fmt or ("unquantised" if not ckpt.config else
                            f"unsupported ({cfg.get('quant_method', cfg.get('model_quant_type'))!r})")
        raise SettingsError(
            f"plugin {plugin!r} syncs {' or '.join(allowed)}, but the rollout engine's checkpoint --hf-checkpoint "
            f"{ckpt.path} is {what}. The engine loads that checkpoint, so the synced tensors would not match its "
            f"layers. Fix: `slime-ascend quantize HF_DIR OUT_DIR --format {wanted}` and pass OUT_DIR as "
            f"--hf-checkpoint (or set {prefix}check_engine_format: false to skip this check)."
        )
    return ckpt


def validate(args: Any, settings: Any) -> None:
    """Start-up check of each sync plugin (every role, the driver's ``parse_args`` first, so a wrong
    ``--hf-checkpoint`` stops before Ray and the engines start): the engine's format."""
    plugin = next(n for n in NAMES if f"ascend_{n.replace('-', '_')}_check_engine_format" in settings)
    checkpoint = getattr(args, "hf_checkpoint", None)
    if not checkpoint or not os.path.isdir(checkpoint):  # none there (yet): slime refuses a missing checkpoint
        return
    if settings[f"ascend_{plugin.replace('-', '_')}_check_engine_format"]:
        check_engine_format(args, plugin, settings)


def megatron_init(args: Any) -> None:
    """megatron_init contribution (order 300): name the engine's format in the train actor's log (checked at
    start by :func:`validate`)."""
    plugin = sync_plugin(args)
    if plugin is not None and runtime.settings(args, plugin).check_engine_format:
        ckpt = checkpoint_format(args)
        logger.info("%s: rollout checkpoint %s is %s", plugin, ckpt.path, ckpt.fmt)


def metrics_enabled(args: Any) -> bool:
    """Condition of the ``train.weight_sync_metrics`` patch: the sync plugin's ``metrics`` setting."""
    plugin = sync_plugin(args)
    return plugin is not None and bool(runtime.settings(args, plugin).metrics)


def distributed_delta_enabled(args: Any) -> bool:
    """The sync plugin's ``distributed_delta`` setting (False without a sync plugin): the distributed push sends
    the changed quantised blocks only (:mod:`.distributed_delta`)."""
    plugin = sync_plugin(args)
    return plugin is not None and bool(runtime.settings(args, plugin).distributed_delta)


def pipelined_send_enabled(args: Any) -> bool:
    """The sync plugin's ``pipelined_send`` setting (False without a sync plugin): on the distributed transport one
    bucket's broadcast is in flight while the next is made (:mod:`.pipelined_send`)."""
    plugin = sync_plugin(args)
    return plugin is not None and bool(runtime.settings(args, plugin).pipelined_send)


def needs_engine_post_process(args: Any, quantization_config: Any) -> bool:
    """True when this sync must open slime's engine post-process gate although slime would not."""
    from .engine_gate import slime_gate_opens

    plugin = sync_plugin(args)
    if plugin != "int8-sync" or slime_gate_opens(quantization_config):
        return False
    if not runtime.settings(args, plugin).engine_post_process:
        return False
    return checkpoint_format(args).fmt in ENGINE_POST_PROCESS_FORMATS


"""The ``mxfp8-sync`` plugin: online MXFP8 (OCP MX, e4m3 + E8M0 per 32) quantisation of synced weights.

Built like ``fp8-sync`` / ``int8-sync`` (``weight_sync.plugin``) and sharing their runtime patches: slime's
quantizer funnel (``train.quantize_params``) runs our dispatcher first, which lands in
:func:`quantize_params` here; the result is the msModelSlim ``W8A8_MXFP8`` tensors that
``slime-ascend quantize --format mxfp8`` writes for the same weights (same function, names and name
policy: ``quant.params.quantize_named_params``), bit for bit, on every transport that goes through the
funnel (distributed, colocated tensors, disk).

Which checkpoint: msModelSlim removes ``quantization_config`` from config.json, so slime passes None;
the format is read from ``--hf-checkpoint``'s ``quant_model_description.json`` (model_quant_type
``W8A8_MXFP8``). A config slime does pass (some other method) is not ours: None, so slime's own quantizer
runs. validate (every process, the driver's ``parse_args`` first) fails with one line when the checkpoint
is not MXFP8, before Ray and the engines start.

Not covered here: SGLang's Ascend MXFP8 layer re-lays its weights out after loading (``weight`` transposed,
``weight_scale`` folded into ``weight_scale_inv``), so an in-place update of such an engine needs slime's
engine post-process gate opened around the sync, as ``int8-sync`` does for W8A8 (``funnel.
needs_engine_post_process``, which names int8-sync only). The torch engine loads the synced tensors as
they are.

It conflicts with the other three sync plugins: one job syncs one format.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from slime_ascend.plugins.base import Contribution, PatchUse, Plugin
from slime_ascend.plugins.settings import Setting, SettingsError

from .plugin import NAMES as OTHER_SYNC_PLUGINS

NAME = "mxfp8-sync"
_M = "slime_ascend.weight_sync.mxfp8_sync."
_PREFIX = "ascend_mxfp8_sync_"


def _enabled(args: Any) -> bool:
    from slime_ascend.plugins import runtime

    return NAME in runtime.active(args).selection.names


def _settings(args: Any) -> Any:
    from slime_ascend.plugins import runtime

    return runtime.settings(args, NAME)


def spec_for(args: Any, quantization_config: Mapping[str, Any] | None):
    """The MXFP8 spec of ``--hf-checkpoint`` for this call of the funnel, or None (plugin off / not ours)."""
    if not _enabled(args):
        return None
    from slime_ascend.quant.hf_config import spec_from_quantization_config
    from slime_ascend.quant.names import MXFP8

    from .engine_gate import source_config
    from .funnel import checkpoint_format

    if source_config(quantization_config) is not None:  # a config.json quantization_config: not msModelSlim's
        return None
    ckpt = checkpoint_format(args)
    if ckpt.fmt != MXFP8:
        return None
    return spec_from_quantization_config(ckpt.config)


def quantize_params(args, megatron_name, converted_named_params, quantization_config, transform_ue8m0=True):
    """The ``quantize_params`` contribution: the checkpoint's MXFP8 tensors, or None (not ours)."""
    spec = spec_for(args, quantization_config)
    if spec is None:
        return None
    from slime_ascend.quant.params import quantize_named_params

    from . import metrics
    from .funnel import _synchronize

    settings = _settings(args)
    named = list(converted_named_params)
    if settings.exact_timing:
        _synchronize([t for _, t in named])
    start = time.perf_counter()
    out = quantize_named_params(named, spec)
    if settings.exact_timing:
        _synchronize([t for _, t in out])
    seconds = time.perf_counter() - start
    if settings.metrics:
        passed = {id(t) for _, t in named}
        metrics.record_quantization(sum(t.numel() * t.element_size() for _, t in named),
                                    sum(t.numel() * t.element_size() for _, t in out), seconds,
                                    len(named) - sum(1 for _, t in out if id(t) in passed))
    return out


def check_engine_format(args: Any) -> None:
    """Fail clearly unless ``--hf-checkpoint`` is an MXFP8 (msModelSlim W8A8_MXFP8) checkpoint."""
    from slime_ascend.quant.names import MXFP8

    from .funnel import checkpoint_format

    ckpt = checkpoint_format(args)
    if ckpt.fmt != MXFP8:
        cfg = ckpt.config or {}
        what = ckpt.fmt or ("unquantised" if not ckpt.config else
                            f"unsupported ({cfg.get('quant_method', cfg.get('model_quant_type'))!r})")
        raise SettingsError(
            f"plugin {NAME!r} syncs mxfp8, but the rollout engine's checkpoint --hf-checkpoint {ckpt.path} is "
            f"{what}. The engine loads that checkpoint, so the synced tensors would not match its layers. Fix: "
            f"`slime-ascend quantize HF_DIR OUT_DIR --format mxfp8` and pass OUT_DIR as --hf-checkpoint (or set "
            f"{_PREFIX}check_engine_format: false to skip this check)."
        )


def validate(args: Any, settings: Any) -> None:
    """Start-up check (every role): the engine's checkpoint is MXFP8 (skipped while none is there yet)."""
    import os

    checkpoint = getattr(args, "hf_checkpoint", None)
    if checkpoint and os.path.isdir(checkpoint) and settings[_PREFIX + "check_engine_format"]:
        check_engine_format(args)


def megatron_init(args: Any) -> None:
    """megatron_init contribution (order 300): name the engine's format in the train actor's log."""
    import logging

    from .funnel import checkpoint_format

    if _enabled(args) and _settings(args).check_engine_format:
        ckpt = checkpoint_format(args)
        logging.getLogger("slime_ascend.weight_sync").info("%s: rollout checkpoint %s is %s", NAME, ckpt.path,
                                                           ckpt.fmt)


def metrics_enabled(args: Any) -> bool:
    """Condition of the ``train.weight_sync_metrics`` patch for this plugin: its ``metrics`` setting."""
    return _enabled(args) and bool(_settings(args).metrics)


MXFP8_SYNC = Plugin(
    name=NAME,
    description="MXFP8 (OCP microscaling: e4m3 + one E8M0 scale per 32 values, msModelSlim W8A8_MXFP8) online "
                "quantisation of synced weights, bit-identical to `slime-ascend quantize --format mxfp8`",
    conflicts=OTHER_SYNC_PLUGINS,
    settings=(
        Setting(_PREFIX + "check_engine_format", bool, True,
                help="at start, read --hf-checkpoint's quant_model_description.json and fail unless it is "
                     "W8A8_MXFP8 (the engine loads that checkpoint, so the synced format must match)"),
        Setting(_PREFIX + "metrics", bool, True,
                help="report perf/weight_sync_* (bytes, quantisation time, GB/s) with slime's perf metrics"),
        Setting(_PREFIX + "exact_timing", bool, True,
                help="synchronise the device around each quantisation so the reported time is real "
                     "(costs one device sync per parameter)"),
    ),
    contributions=(
        Contribution("quantize_params", _M + "quantize_params",
                     note="MXFP8 tensors for the names the rollout checkpoint quantises; None = not ours"),
        Contribution("megatron_init", _M + "megatron_init", order=300, note="name the rollout checkpoint's format"),
    ),
    patches=(
        PatchUse("train.quantize_params", "train"),
        PatchUse("train.weight_sync_metrics", "train", when=_M + "metrics_enabled"),
        PatchUse("driver.acknowledged_weight_update", "import:slime.ray.actor_group"),
    ),
    validate=_M + "validate",
)

"""The ``fp8-sync``, ``int8-sync``, ``int4-sync`` and ``mxfp8-sync`` plugins: online-quantised weight sync.

Each plugin makes stock slime send the rollout engine's checkpoint format at every weight sync,
bit-identical to ``slime-ascend quantize`` (the offline converter), over every transport
(distributed broadcast, colocated tensors, disk and delta):

* runtime patches, installed in each train actor as it starts: ``train.quantize_params`` (slime's
  quantizer funnel runs our dispatcher first), ``train.quant_post_process`` (engine-side repack
  around the sync for formats whose engine layout differs from the checkpoint's) and, with the
  ``metrics`` setting, ``train.weight_sync_metrics`` (bytes, quantisation time and GB/s on slime's
  perf log).
* validate (every process, the driver's ``parse_args`` first): reads the format of ``--hf-checkpoint``
  (config.json ``quantization_config``, or msModelSlim's ``quant_model_description.json``) and fails
  with one line when it is not the plugin's format, before Ray and the engines start; megatron_init
  (order 300) names it in the train actor's log.
* quantize_params (exclusive, :func:`slime_ascend.weight_sync.funnel.quantize_params`): quantises
  what the checkpoint quantises (its ignore list / FLOAT entries; embeddings, norms, router and
  lm_head stay in the model dtype unless it says otherwise); returns None for configs that are
  not ours, so slime's own quantizer runs.

The four plugins conflict with one another: one job syncs one format.

``mxfp8-sync`` syncs OCP MX (e4m3 + one E8M0 scale per 32 values) in msModelSlim's ``W8A8_MXFP8`` layout.
msModelSlim removes ``quantization_config`` from config.json, so slime passes None and the format is read from
``--hf-checkpoint``'s ``quant_model_description.json``, as for int8-sync's W8A8. SGLang's Ascend MXFP8 layer
re-lays its weights out after loading (``weight`` transposed, ``weight_scale`` folded into ``weight_scale_inv``);
whether its restore-before-load undoes that has not been checked, so ``funnel.ENGINE_POST_PROCESS_FORMATS`` names
W8A8 only and an in-place mxfp8 update of such an engine is not covered yet. The torch engine loads the synced
tensors as they are.
"""

from __future__ import annotations

from slime_ascend.plugins.base import Contribution, PatchUse, Plugin
from slime_ascend.plugins.settings import Setting

_W = "slime_ascend.weight_sync."
PATCHES = (
    PatchUse("train.quantize_params", "train"),
    PatchUse("train.quant_post_process", "train"),
    PatchUse("train.weight_sync_metrics", "train", when=_W + "funnel.metrics_enabled"),
    # the end of the sync chain: every engine switches to the new version, acknowledged, or none does
    PatchUse("driver.acknowledged_weight_update", "import:slime.ray.actor_group"),
    # ... also over slime's collectives (distributed, tensor): every engine's version read back and published
    PatchUse("driver.acknowledged_collective_update", "import:slime.ray.actor_group"),
    # quantised weights over gloo (cpu): float8 broadcast as its bytes
    PatchUse("train.gloo_float8_broadcast", "train"),
    # the distributed push with one bucket in flight while the next is gathered and quantised
    PatchUse("train.pipelined_weight_send", "train", when="slime_ascend.patch.train.pipelined_weight_send.wanted"),
    # after --load the versions go on from the resumed rollout (not from 1 again)
    PatchUse("driver.resumed_weight_version", "import:slime.ray.actor_group"),
)
NAMES = ("fp8-sync", "int8-sync", "int4-sync", "mxfp8-sync")


def _sync_plugin(name: str, label: str, description: str, *extra: Setting) -> Plugin:
    """One of the four: the settings they share (``ascend_<name>_...``) and ``extra``, the funnel's contributions;
    it conflicts with the other three."""
    prefix = "ascend_" + name.replace("-", "_") + "_"
    return Plugin(
        name=name,
        description=description,
        conflicts=tuple(n for n in NAMES if n != name),
        settings=(
            Setting(prefix + "check_engine_format", bool, True,
                    help="at megatron init, read --hf-checkpoint's quantization config and fail unless it is this "
                         "plugin's format (the engine loads that checkpoint, so the synced format must match)"),
            Setting(prefix + "metrics", bool, True,
                    help="report perf/weight_sync_* (bytes, quantisation time, GB/s) with slime's perf metrics"),
            Setting(prefix + "exact_timing", bool, True,
                    help="synchronise the device around each quantisation so the reported time is real "
                         "(costs one device sync per parameter)"),
            Setting(prefix + "distributed_delta", bool, False,
                    help="on the distributed transport, push only the quantised blocks (32 bytes, with their "
                         "scales) that changed since the version every engine acknowledged; an engine that does "
                         "not hold it gets the version whole (weight_sync.distributed_delta)"),
            Setting(prefix + "pipelined_send", bool, False,
                    help="on the distributed transport, send each bucket on a sender thread while the next one is "
                         "gathered and quantised, one bucket in flight, in order (one more bucket in memory: "
                         "weight_sync.pipelined_send). Off by default: on the 2-core CPU host, where the receiver "
                         "shares the cores, it measured within noise of slime's order (bench_weight_sync)"),
            *extra,
        ),
        contributions=(
            Contribution("quantize_params", _W + "funnel.quantize_params",
                         note=f"{label} tensors for the names the rollout checkpoint quantises; None = not ours"),
            Contribution("megatron_init", _W + "funnel.megatron_init", order=300,
                         note="check the rollout checkpoint's format"),
        ),
        patches=PATCHES,
        validate=_W + "funnel.validate",
    )


FP8_SYNC = _sync_plugin(
    "fp8-sync", "fp8-block",
    "FP8 block-wise (e4m3, weight_scale_inv) online quantisation of synced weights, bit-identical to "
    "`slime-ascend quantize --format fp8-block`",
)
INT8_SYNC = _sync_plugin(
    "int8-sync", "int8",
    "INT8 online quantisation of synced weights: Ascend W8A8_DYNAMIC (msModelSlim) or compressed-tensors W8A8, as "
    "the rollout checkpoint says",
    Setting("ascend_int8_sync_format", str, "auto", choices=("auto", "int8-w8a8", "int8-ct"),
            help="auto = the rollout checkpoint's format; int8-w8a8 = Ascend msModelSlim W8A8_DYNAMIC "
                 "(quant_model_description.json), int8-ct = compressed-tensors int-quantized"),
    Setting("ascend_int8_sync_engine_post_process", bool, True,
            help="for int8-w8a8, ask the engines to restore their weight layout before the sync and "
                 "repack it after (slime does so only for compressed-tensors checkpoints)"),
)
INT4_SYNC = _sync_plugin(
    "int4-sync", "int4-group",
    "INT4 group (compressed-tensors pack-quantized) online quantisation of synced weights",
    Setting("ascend_int4_sync_numerics", str, "compressed-tensors", choices=("compressed-tensors", "torchao", "slime"),
            help="whose INT4 scale/rounding rule to reproduce: compressed-tensors (amax/7.5; the offline "
                 "converter's), torchao (QAT fake quant) or slime (its CUDA QAT kernel, amax/7)"),
)

MXFP8_SYNC = _sync_plugin(
    "mxfp8-sync", "mxfp8",
    "MXFP8 (OCP microscaling: e4m3 + one E8M0 scale per 32 values, msModelSlim W8A8_MXFP8) online quantisation of "
    "synced weights, bit-identical to `slime-ascend quantize --format mxfp8`",
)

PLUGINS = (FP8_SYNC, INT8_SYNC, INT4_SYNC, MXFP8_SYNC)

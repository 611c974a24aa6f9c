"""The ``qat`` plugin: quantisation-aware training with the exporter's own quantiser.

Declarations only (no torch). In slime's train actors every forward (the log-prob passes and the train steps, RL or
``--loss-type sft_loss``) uses ``dequant(quant(W))`` of each linear weight the exporter quantises, bit for bit the
weights ``slime-ascend quantize`` writes and ``int4-sync`` / ``fp8-sync`` / ``int8-sync`` push, with a
straight-through backward to the floating master weights (:mod:`slime_ascend.qat.modules`). With a sync plugin on,
the spec is the one it pushes; otherwise the settings' (:mod:`slime_ascend.qat.spec`).

* before_log_prob and before_train_step (train): install the fake-quant hooks on the model chunks (first call).
* validate (every process, the driver's ``parse_args`` first): the spec agrees with the sync plugin's; a shard's
  input dim holds whole int4 groups at this TP / expert-TP; fp8-block at TP 1; no gradient-accumulation fusion.
"""

from __future__ import annotations

from ..plugins.base import Contribution, Plugin
from ..plugins.settings import Setting

_Q = "slime_ascend.qat."

PLUGIN = Plugin(
    name="qat",
    description="quantisation-aware training: Megatron's linear weights fake-quantised in the forward with the "
                "exporter's quantiser (int4-group by default; fp8-block, int8), straight-through backward",
    settings=(
        Setting("ascend_qat_format", str, "int4-group", choices=("int4-group", "fp8-block", "int8-ct", "int8-w8a8"),
                help="the format whose dequant(quant(W)) the forward uses; with a sync plugin on it must be the "
                     "format that plugin pushes"),
        Setting("ascend_qat_group_size", int, None, optional=True, minimum=1,
                help="int4-group group size (unset: the pushed checkpoint's with a sync plugin, else 128, as "
                     "`slime-ascend quantize --group-size`)"),
        Setting("ascend_qat_numerics", str, None, optional=True, choices=("compressed-tensors", "torchao", "slime"),
                help="int4 scale/rounding rule (unset: int4-sync's ascend_int4_sync_numerics when on, else "
                     "compressed-tensors, the offline converter's)"),
    ),
    contributions=(
        Contribution("before_log_prob", _Q + "modules.before_log_prob", order=100,
                     note="install the fake-quant hooks before the forward-only passes"),
        Contribution("before_train_step", _Q + "modules.before_train_step", order=100,
                     note="install the fake-quant hooks before the train steps (RL and SFT)"),
    ),
    validate=_Q + "spec.validate",
)

"""The quantisation config slime's updaters see during one sync when the engine must repack.

slime asks the engines to restore their weight layout before a sync and to re-run their
post-load processing after it only when ``quantization_config["quant_method"]`` is
``"compressed-tensors"`` (a hard-coded list in ``UpdateWeightFromDistributed.update_weights`` and
``UpdateWeightFromTensor.update_weights``). An Ascend W8A8_DYNAMIC checkpoint has no
``quantization_config`` (msModelSlim writes ``quant_model_description.json``), yet its engine
layout (transposed, NZ-cast weight; flattened scales) differs from the checkpoint's, so a
sync without that round trip writes into the wrong layout.

:class:`PostProcessGate` is a dict that answers ``"compressed-tensors"`` for ``quant_method`` and
carries the real config in ``source``. ``train.quant_post_process`` puts it on the updater for
the duration of one ``update_weights`` call; ``train.quantize_params`` and our funnel unwrap it,
so no quantizer ever sees it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SLIME_POST_PROCESS_METHODS = ("compressed-tensors",)  # slime's hard-coded gate list


class PostProcessGate(dict):
    def __init__(self, source: Mapping[str, Any] | None) -> None:
        super().__init__(dict(source or {}))
        self["quant_method"] = SLIME_POST_PROCESS_METHODS[0]
        self.source = source


def source_config(cfg: Any) -> Any:
    """The real quantisation config behind a :class:`PostProcessGate` (others unchanged)."""
    return cfg.source if isinstance(cfg, PostProcessGate) else cfg


def slime_gate_opens(cfg: Any) -> bool:
    """Whether slime's own gate already triggers engine post-processing for ``cfg``."""
    return bool(cfg) and isinstance(cfg, Mapping) and cfg.get("quant_method") in SLIME_POST_PROCESS_METHODS

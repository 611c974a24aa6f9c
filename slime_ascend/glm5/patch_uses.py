"""The runtime patches slime's GLM-5 spec needs where CUDA is absent, as the ``cpu`` and ``npu`` plugins declare
them (one tuple, so both declare the same set): the kernel stand-ins as soon as ``slime_plugins.models`` is
imported (before any glm5 module), the others as ``glm5.py`` is imported."""

from __future__ import annotations

from ..plugins.base import PatchUse

_WHEN = "slime_ascend.glm5.kernels.device_neutral_ops_wanted"

GLM5_PATCH_USES: tuple[PatchUse, ...] = (
    PatchUse("train.glm5_kernels", "import:slime_plugins.models", when=_WHEN),
    PatchUse("train.glm5_host_spec", when=_WHEN),
    PatchUse("train.glm5_thd_rope", when=_WHEN),
    PatchUse("train.glm5_index_topk", when=_WHEN),
)

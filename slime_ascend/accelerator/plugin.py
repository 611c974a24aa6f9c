"""The ``npu`` plugin: slime on Ascend NPUs.

Process start (every process, from the bootstrap): register the ``npu`` accelerator as soon as
``slime.utils.accelerator`` is imported; make slime's Ray code ask for ``NPU`` resources; and,
on hosts with torch_npu (or when forced with ``SLIME_ASCEND_NPU_KERNEL_PATCHES=on``), import
MindSpeed's adaptor before Megatron, disable jit/compile fusion and fix the fc1 gather layout.
In each train actor, as it starts, the runtime then calls MindSpeed's ``repatch(args)``.

With the ``cpu`` plugin on a host without torch_npu (``SLIME_ASCEND_PLUGINS=cpu,npu``), ``npu`` runs
on the host: the same registration, Ray ``NPU`` resources and ``ASCEND_RT_VISIBLE_DEVICES`` handling,
with the host's device operations (:func:`npu.accelerator_class` ``("cpu")``, gloo) and the ``cpu``
plugin's Megatron shims in place of torch_npu's. Ray must advertise ``NPU`` (``ray start --resources
'{"NPU": 8}'`` or ``RAY_OVERRIDE_RESOURCES``). It is how an Ascend launch is checked on a CPU host,
and how CI runs the ``npu`` plugin inside slime's loop.
"""

from __future__ import annotations

import logging
import os

from .. import _import_hooks, host
from ..plugins.base import PatchUse, Plugin
from ..glm5.patch_uses import GLM5_PATCH_USES
from . import npu

logger = logging.getLogger("slime_ascend.accelerator")

KERNEL_PATCHES_ENV = "SLIME_ASCEND_NPU_KERNEL_PATCHES"  # auto (default) | on | off
KERNEL_PATCHES = ("train.disable_torch_compile", "train.fc1_gather_layout")


def kernel_patches_enabled() -> bool:
    mode = os.environ.get(KERNEL_PATCHES_ENV, "auto").strip().lower()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"{KERNEL_PATCHES_ENV}={mode!r}: use auto, on or off")
    return mode == "on" or (mode == "auto" and host.torch_npu_installed())


def on_process_start() -> None:
    here = host.on_host()
    _import_hooks.when_imported("slime.utils.accelerator", lambda module: npu.register(module, on_host=here))
    if kernel_patches_enabled():
        from .mindspeed import import_adaptor_before_megatron

        if not import_adaptor_before_megatron():
            logger.warning("MindSpeed adaptor not scheduled (not installed, or megatron was imported first)")


def mindspeed_wanted(args) -> bool:
    """Condition of ``train.mindspeed_repatch``: the kernel patches are on and MindSpeed is installed."""
    from .mindspeed import mindspeed_installed

    return kernel_patches_enabled() and mindspeed_installed()


_A = "slime_ascend.accelerator.plugin."

PLUGIN = Plugin(
    name="npu",
    description="Ascend NPU accelerator (HCCL, Ray NPU resources, ASCEND_RT_VISIBLE_DEVICES, MindSpeed bootstrap)",
    process_start=(_A + "on_process_start",),
    patches=(PatchUse("driver.ray_npu_resources"),)
    + tuple(PatchUse(p, when=_A + "kernel_patches_enabled") for p in KERNEL_PATCHES)
    + (PatchUse("train.mindspeed_repatch", "train", when=_A + "mindspeed_wanted"),)
    + GLM5_PATCH_USES,  # slime's glm5 spec: torch_npu's sparse attention where it fits, else torch ops
)

"""The ``npu`` plugin: slime on Ascend NPUs.

Process start (every process, from the bootstrap): register the ``npu`` accelerator as soon as
``slime.utils.accelerator`` is imported; make slime's Ray code ask for ``NPU`` resources; and,
on hosts with torch_npu (or when forced with ``SLIME_ASCEND_NPU_KERNEL_PATCHES=on``), import
MindSpeed's adaptor before Megatron, disable jit/compile fusion and fix the fc1 gather layout.
In each train actor, as it starts, the runtime then calls MindSpeed's ``repatch(args)``.
Without MindSpeed (torch_npu present, MindSpeed not installed: :func:`without_mindspeed`), processes that import
Megatron import ``torch_npu.contrib.transfer_to_npu`` before it instead, and get MindSpeed's two Megatron adaptations
``transfer_to_npu`` lacks as runtime patches (``train.npu_tensor_type``, ``train.npu_cuda_rng_state``,
``train.npu_device_arch_version``); the emulated
device (``SLIME_ASCEND_EMULATE_NPU=1``) runs slime's loop this way in CI.

With the ``cpu`` plugin on a host without torch_npu (``SLIME_ASCEND_PLUGINS=cpu,npu``), ``npu`` runs
on the host: the same registration, Ray ``NPU`` resources and ``ASCEND_RT_VISIBLE_DEVICES`` handling,
with the host's device operations (:func:`npu.accelerator_class` ``("cpu")``, gloo) and the ``cpu``
plugin's Megatron shims in place of torch_npu's. Ray must advertise ``NPU`` (``ray start --resources
'{"NPU": 8}'`` or ``RAY_OVERRIDE_RESOURCES``). It is how an Ascend launch is checked on a CPU host,
and how CI runs the ``npu`` plugin inside slime's loop.

At ``parse_args`` (:mod:`.launch`): ``offload_train: false`` in its YAML (torch_memory_saver's NPU build has no
preload hook mode), ``--colocate`` only with ``--release-train``, and never both allocator variables.
"""

from __future__ import annotations

import logging
import os

from .. import _import_hooks, host
from ..plugins.base import PatchUse, Plugin
from ..glm5.patch_uses import GLM5_PATCH_USES
from . import launch, npu

logger = logging.getLogger("slime_ascend.accelerator")

KERNEL_PATCHES_ENV = "SLIME_ASCEND_NPU_KERNEL_PATCHES"  # auto (default) | on | off
KERNEL_PATCHES = ("train.disable_torch_compile", "train.fc1_gather_layout")


def kernel_patches_enabled() -> bool:
    mode = os.environ.get(KERNEL_PATCHES_ENV, "auto").strip().lower()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"{KERNEL_PATCHES_ENV}={mode!r}: use auto, on or off")
    return mode == "on" or (mode == "auto" and host.torch_npu_installed())


def on_process_start() -> None:
    from ..compat import typing_override

    typing_override.ensure()  # megatron-core >= 0.17 on Python 3.11 (what the cpu plugin does too)
    here = host.on_host()
    _import_hooks.when_imported("slime.utils.accelerator", lambda module: npu.register(module, on_host=here))
    if without_mindspeed():
        from .mindspeed import import_transfer_to_npu_before_megatron

        if not import_transfer_to_npu_before_megatron():
            logger.warning("torch_npu.contrib.transfer_to_npu not scheduled (megatron was imported first)")
    elif kernel_patches_enabled():
        from .mindspeed import import_adaptor_before_megatron

        if not import_adaptor_before_megatron():
            logger.warning("MindSpeed adaptor not scheduled (not installed, or megatron was imported first)")


def validate(args, settings) -> None:
    """What an Ascend launch must satisfy before anything starts (:mod:`.launch`): train offload the NPU build
    of torch_memory_saver supports, and one allocator variable; the first problem is refused in one line."""
    from ..plugins import runtime
    from ..plugins.settings import SettingsError

    names = runtime.enabled_names(args)
    found = launch.problems(args, runtime.environ(), on_device=not ("cpu" in names and "npu" in names))
    if found:
        raise SettingsError(found[0])


def mindspeed_wanted(args) -> bool:
    """Condition of ``train.mindspeed_repatch``: the kernel patches are on and MindSpeed is installed."""
    from .mindspeed import mindspeed_installed

    return kernel_patches_enabled() and mindspeed_installed()


def without_mindspeed() -> bool:
    """An Ascend host (torch_npu importable, kernel patches on) without MindSpeed: Megatron runs through
    ``transfer_to_npu`` plus MindSpeed's two adaptations as runtime patches (:mod:`.mindspeed`)."""
    from .mindspeed import mindspeed_installed

    return kernel_patches_enabled() and host.torch_npu_installed() and not mindspeed_installed()


_A = "slime_ascend.accelerator.plugin."
# MindSpeed's adaptations of Megatron that transfer_to_npu lacks, where MindSpeed is absent (without_mindspeed)
MINDSPEED_ADAPTATIONS = (PatchUse("train.npu_tensor_type", "import:megatron.core", when=_A + "without_mindspeed"),
                         PatchUse("train.npu_cuda_rng_state", when=_A + "without_mindspeed"),
                         PatchUse("train.npu_device_arch_version", "import:megatron.training.arguments",
                                  when=_A + "without_mindspeed"))

PLUGIN = Plugin(
    name="npu",
    description="Ascend NPU accelerator (HCCL, Ray NPU resources, ASCEND_RT_VISIBLE_DEVICES, MindSpeed bootstrap)",
    process_start=(_A + "on_process_start",),
    patches=(PatchUse("driver.ray_npu_resources"),)
    + tuple(PatchUse(p, when=_A + "kernel_patches_enabled") for p in KERNEL_PATCHES)
    + (PatchUse("train.mindspeed_repatch", "train", when=_A + "mindspeed_wanted"),)
    + MINDSPEED_ADAPTATIONS
    # --mtp-num-layers where Megatron-core names the MTP layer's decoder layer mtp_model_layer (0.19 on)
    # and slime's mtp_kwargs where its Megatron patch is absent (stock Megatron-core derives the same MTP labels)
    + (PatchUse("train.mtp_layer_name", "train", when="slime_ascend.patch.train.mtp_layer_name.wanted"),
       PatchUse("train.mtp_training", "train", when="slime_ascend.patch.train.mtp_training.wanted"))
    + GLM5_PATCH_USES,  # slime's glm5 spec: torch_npu's sparse attention where it fits, else torch ops
    # slime's offload_train LD_PRELOADs torch_memory_saver's preload hook, which its NPU build does not support
    # (colocation on NPU: --release-train; launch.py); applied after slime's --colocate / critic rules
    slime_args=launch.SLIME_ARGS,
    validate=_A + "validate",
)

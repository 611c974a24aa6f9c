"""MindSpeed on Ascend: its adaptor must be imported before anything imports Megatron.

``mindspeed.megatron_adaptor`` patches Megatron at import; the ``npu`` plugin's process-start action
arranges that import (:func:`import_adaptor_before_megatron`). The second half, ``repatch(args)`` with
slime's final args, is the runtime patch ``train.mindspeed_repatch``.

Without MindSpeed (it is not installable everywhere: PyPI holds only a placeholder), a process that imports Megatron
gets what an Ascend user puts at the top of CUDA code, ``torch_npu.contrib.transfer_to_npu``, imported before
Megatron (:func:`import_transfer_to_npu_before_megatron`), and MindSpeed's Megatron adaptations that
``transfer_to_npu`` lacks as runtime patches (``train.npu_tensor_type``, ``train.npu_cuda_rng_state``,
``train.npu_device_arch_version``).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os

from .. import _import_hooks

logger = logging.getLogger("slime_ascend.accelerator")

ADAPTOR = "mindspeed.megatron_adaptor"
TRANSFER_TO_NPU = "torch_npu.contrib.transfer_to_npu"


def mindspeed_installed() -> bool:
    return importlib.util.find_spec("mindspeed") is not None


def import_adaptor_before_megatron() -> bool:
    """Arrange for the adaptor to be imported before Megatron. False when too late or absent."""
    if not mindspeed_installed():
        return False
    return _import_hooks.before_import("megatron", lambda: importlib.import_module(ADAPTOR))


# torch_npu's get_device_capability() answers None unless this is set ("major.minor"; torch_npu's documentation:
# only for compatibility with torch.cuda.get_device_capability, not the NPU's capability)
CAPABILITY_ENV = "TORCH_NPU_DEVICE_CAPABILITY"
CAPABILITY_DEFAULT = "8.0"


def _transfer_to_npu() -> None:
    """``transfer_to_npu`` makes ``torch.cuda.is_available()`` torch_npu's (True) and
    ``torch.cuda.get_device_capability()`` torch_npu's (None unless ``TORCH_NPU_DEVICE_CAPABILITY`` is set). slime's
    train actor imports SGLang's quantization layers, whose ``get_device_sm()`` unpacks that capability at import
    when CUDA reads as available: it raises ``TypeError`` there. Where the variable is unset, it is set to
    ``8.0`` (torch_npu's documented example; below 9.0, so SGLang's SM90+ paths stay off) first, and logged."""
    if not os.environ.get(CAPABILITY_ENV):
        os.environ[CAPABILITY_ENV] = CAPABILITY_DEFAULT
        logger.info("npu: %s=%s (it was unset; torch.cuda.get_device_capability() under transfer_to_npu is "
                    "torch_npu's, None without it, and SGLang's get_device_sm unpacks it)", CAPABILITY_ENV,
                    CAPABILITY_DEFAULT)
    importlib.import_module(TRANSFER_TO_NPU)
    logger.info("npu: MindSpeed is not installed: %s imported before Megatron", TRANSFER_TO_NPU)


def import_transfer_to_npu_before_megatron() -> bool:
    """Arrange for ``torch_npu.contrib.transfer_to_npu`` (importing it applies it: ``torch.cuda`` and ``cuda``
    devices mean ``npu``, ``nccl`` means ``hccl``) to be imported before Megatron (:func:`_transfer_to_npu`). False
    when too late."""
    return _import_hooks.before_import("megatron", _transfer_to_npu)

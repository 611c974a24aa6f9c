"""MindSpeed on Ascend: its adaptor must be imported before anything imports Megatron.

``mindspeed.megatron_adaptor`` patches Megatron at import; the ``npu`` plugin's process-start action
arranges that import (:func:`import_adaptor_before_megatron`). The second half, ``repatch(args)`` with
slime's final args, is the runtime patch ``train.mindspeed_repatch``.
"""

from __future__ import annotations

import importlib
import importlib.util

from .. import _import_hooks

ADAPTOR = "mindspeed.megatron_adaptor"


def mindspeed_installed() -> bool:
    return importlib.util.find_spec("mindspeed") is not None


def import_adaptor_before_megatron() -> bool:
    """Arrange for the adaptor to be imported before Megatron. False when too late or absent."""
    if not mindspeed_installed():
        return False
    return _import_hooks.before_import("megatron", lambda: importlib.import_module(ADAPTOR))

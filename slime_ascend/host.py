"""What this host offers the device plugins, and the one decision the ``cpu`` and ``npu`` plugins share.

Both plugins import this module: ``accelerator`` builds its on-host ``npu`` on ``cpu``'s host backend, so ``cpu``
never imports ``accelerator``.
"""

from __future__ import annotations

import importlib.util


def module_installed(name: str) -> bool:
    """Whether module ``name`` can be found, without importing it (False where its parent is missing, or where
    ``sys.modules`` holds None for it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


#: the allocator settings torch_npu reads (it refuses to start its allocator when both are set): the npu plugin
#: refuses the clash at parse_args, the sglang-npu bridge strips what the NPU build does not support from both
ALLOC_CONF_ENVS = ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def torch_npu_installed() -> bool:
    return module_installed("torch_npu")


def on_host() -> bool:
    """True where plugins ``cpu`` and ``npu`` are enabled together: ``npu`` runs over the host's device
    operations and owns the Ray resources. The one decision both plugins ask; refused (PluginError) on a
    host with torch_npu, where the chip is there."""
    from .plugins import runtime
    from .plugins.registry import PluginError

    names = runtime.enabled_names()
    if "cpu" not in names or "npu" not in names:
        return False
    if torch_npu_installed():
        raise PluginError("plugins 'cpu' and 'npu' together run npu on the host, but this host has torch_npu. "
                          "Fix: drop 'cpu' from SLIME_ASCEND_PLUGINS / ascend_plugins to run on the NPUs.")
    return True

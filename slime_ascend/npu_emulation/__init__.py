"""TEST DOUBLE: an emulated Ascend device for tests and dry runs, on host memory and CPU kernels.

Nothing here runs on an NPU, and nothing here is installed unless asked: :func:`install` (or
``SLIME_ASCEND_EMULATE_NPU=1`` in a process the bootstrap starts, see :func:`arm_from_environment`) makes
this interpreter look like an Ascend host with torch_npu:

* the ``npu`` device type (:mod:`.device`): tensors on ``npu:N`` whose data lives in host memory, with
  autograd, optimizers, ``.to("npu")`` / ``.cpu()``, one random generator per device, memory accounting, and
  a real device's refusal of operators that mix ``npu`` and ``cpu`` tensors;
* ``torch.npu`` (:mod:`.npu_module`), what torch_npu provides there (device count from
  ``ASCEND_RT_VISIBLE_DEVICES``, streams, events, memory figures, random state);
* the ``hccl`` process-group backend (:mod:`.hccl`): gloo underneath, HCCL's environment read as HCCL would;
* a ``torch_npu`` package in ``sys.modules`` (:mod:`.torch_npu_module`): ``__version__`` ends in
  ``+emulated`` and ``torch_npu._SLIME_ASCEND_EMULATED`` is True; ``torch_npu.contrib.transfer_to_npu``
  (:mod:`.transfer_to_npu`) redirects ``torch.cuda`` and ``"cuda"`` devices to ``npu`` when imported, as the
  real one does; the ``torch.ops.npu`` operators come from ``slime_ascend.npu_emulation.ops`` when present;
* on request (``install(memory_saver=True)``, or ``SLIME_ASCEND_EMULATE_MEMORY_SAVER=1``), the NPU build of
  torch_memory_saver (:mod:`.memory_saver`), which refuses the ``preload`` hook mode as its README does.

It never shadows a real torch_npu: where one is importable, :func:`install` refuses in one line
(:class:`EmulationRefused`). Installing is idempotent, thread-safe and cannot be undone in the process (torch's
``PrivateUse1`` backend can be named once), so tests run it in a subprocess.

What it cannot tell you: NPU kernels' numerics, formats and performance, HCCL's timing and topology, memory
limits of a real card (all devices share the host's memory), or anything of CANN below torch_npu.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
from types import ModuleType

ENV = "SLIME_ASCEND_EMULATE_NPU"
MEMORY_SAVER_ENV = "SLIME_ASCEND_EMULATE_MEMORY_SAVER"
TRUE = ("1", "true", "yes", "on")


class EmulationRefused(RuntimeError):
    """The emulation was asked for where it must not run (a real torch_npu, another PrivateUse1 backend)."""


_lock = threading.RLock()
_installed = False
_memory_saver = False


def enabled_in(environ=os.environ) -> bool:
    """Whether ``SLIME_ASCEND_EMULATE_NPU`` asks for the emulation (1/true/yes/on; 0/false/no/off/empty: no)."""
    value = environ.get(ENV, "").strip().lower()
    if value in TRUE:
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise EmulationRefused(f"{ENV}={environ.get(ENV)!r}: use 1 to emulate an Ascend device, 0 or unset not to")


def memory_saver_in(environ=os.environ) -> bool:
    return environ.get(MEMORY_SAVER_ENV, "").strip().lower() in TRUE


def installed() -> bool:
    return _installed


def real_torch_npu_origin() -> str | None:
    """Where a real torch_npu would be imported from, or None (the emulation's own is not counted)."""
    module = sys.modules.get("torch_npu")
    if module is not None:
        if getattr(module, "_SLIME_ASCEND_EMULATED", False):
            return None
        return getattr(module, "__file__", None) or "sys.modules['torch_npu']"
    from .torch_npu_module import EmulatedFinder

    for finder in sys.meta_path:
        if isinstance(finder, EmulatedFinder) or not hasattr(finder, "find_spec"):
            continue
        try:
            spec = finder.find_spec("torch_npu", None)
        except (ImportError, ValueError):
            continue
        if spec is not None:
            return spec.origin or str(spec.submodule_search_locations or "torch_npu")
    return None


def refuse_if_real() -> None:
    origin = real_torch_npu_origin()
    if origin is not None:
        raise EmulationRefused(f"the npu emulation refuses to run: a real torch_npu is importable ({origin}). "
                               f"Fix: unset {ENV} to use the real device.")


def install(*, memory_saver: bool = False) -> ModuleType:
    """Install the emulated device and torch_npu in this process (see the module doc); returns ``torch_npu``.

    Idempotent; ``memory_saver=True`` (now or in a later call) also installs the emulated torch_memory_saver.
    Raises :class:`EmulationRefused` where a real torch_npu is importable."""
    global _installed
    refuse_if_real()
    import torch  # where the emulation is armed, this import may itself install it (the torch import hook)

    with _lock:
        if not _installed:
            name = torch._C._get_privateuse1_backend_name()
            if name not in ("privateuseone", "npu") or getattr(torch, "npu", None) is not None:
                raise EmulationRefused(f"the npu emulation refuses to run: torch's PrivateUse1 backend is already "
                                       f"{name!r} (torch.npu: {getattr(torch, 'npu', None)!r})")
            from . import device, hccl, npu_module, torch_npu_module

            device.register_backend(npu_module)
            device.configure(npu_module.configured_device_count())
            npu_module.setup()
            hccl.register()
            torch_npu_module.register_modules()
            torch_npu_module.set_installer(install)
            torch_npu_module.add_finder()
            _installed = True
            _register_ops()
        if memory_saver:
            _install_memory_saver()
        return sys.modules["torch_npu"]


def _register_ops() -> None:
    """The ``torch.ops.npu`` operators, from ``slime_ascend.npu_emulation.ops`` when that module exists."""
    if importlib.util.find_spec(f"{__name__}.ops") is None:
        return
    ops = importlib.import_module(f"{__name__}.ops")
    register = getattr(ops, "register", None)
    attach = getattr(ops, "attach", None)
    if register is not None:
        register()
    if attach is not None:
        attach(sys.modules["torch_npu"])


def _install_memory_saver() -> None:
    global _memory_saver
    if _memory_saver:
        return
    from . import memory_saver

    memory_saver.install()
    _memory_saver = True


_armed = False


def arm_from_environment(environ=os.environ) -> bool:
    """The bootstrap's hook (every process of a slime job, before any plugin's process-start code): when
    ``SLIME_ASCEND_EMULATE_NPU`` is set, refuse at once on a host with a real torch_npu, else make ``torch_npu``
    importable and install the emulation when torch is first imported (or now, if it already is). Imports no
    torch itself. Returns whether it armed."""
    global _armed
    if not enabled_in(environ):
        return False
    with _lock:
        if _armed:
            return True
        refuse_if_real()
        from . import torch_npu_module

        torch_npu_module.set_installer(install)
        torch_npu_module.arm(memory_saver=memory_saver_in(environ))
        _armed = True
    return True

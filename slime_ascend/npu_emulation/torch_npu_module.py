"""TEST DOUBLE: the ``torch_npu`` package of the emulated device (see :mod:`slime_ascend.npu_emulation`).

:func:`register_modules` puts in ``sys.modules`` what the package, slime, Megatron and MindSpeed import from
torch_npu: ``torch_npu`` (``__version__`` ends in ``+emulated``; ``_SLIME_ASCEND_EMULATED = True``),
``torch_npu.npu`` (the same module object as ``torch.npu``) with its ``amp``, ``memory``, ``random``,
``streams`` and ``utils`` submodules, ``torch_npu.contrib``, ``torch_npu.utils``, ``torch_npu.distributed`` and
``torch_npu.multiprocessing.reductions`` (imported by SGLang's ``patch_torch``; IPC rebuilds refused as not
emulated).
``torch_npu.contrib.transfer_to_npu`` is left to be imported: :class:`EmulatedFinder` loads it from
:mod:`.transfer_to_npu`, whose import redirects ``torch.cuda`` as the real one's does.

:func:`arm` (the bootstrap's path) makes ``torch_npu`` findable before torch is imported, without importing it:
``importlib.util.find_spec("torch_npu")`` answers (so :func:`slime_ascend.host.torch_npu_installed` is True),
``import torch_npu`` installs the emulation, and so does the first ``import torch`` (as torch's device-backend
autoload imports a real torch_npu).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import types

VERSION = "2.14.0+emulated"
ROOT = "torch_npu"
TRANSFER = "torch_npu.contrib.transfer_to_npu"
MEMORY_SAVER = "torch_memory_saver"

_lock = threading.Lock()
_armed = {"memory_saver": False}
_installer = None  # slime_ascend.npu_emulation.install, handed in by it (set_installer)


def set_installer(install) -> None:
    global _installer
    _installer = install


def _module(name: str, attributes: dict | None = None, package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, _LOADER, is_package=package)
    module.__loader__ = _LOADER
    module.__file__ = __file__  # where the stand-in is defined (tools that print a module's origin)
    if package:
        module.__path__ = []
        module.__spec__.submodule_search_locations = []
    module.__dict__.update(attributes or {})
    return module


def register_modules() -> types.ModuleType:
    """Create the torch_npu modules and put them in ``sys.modules`` (called once by install, torch imported)."""
    import torch

    from . import hccl, npu_module

    npu = torch.npu  # registered by device.register_backend: this package's npu_module
    npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu.npu", _LOADER, is_package=True)
    npu.__spec__.submodule_search_locations = []
    npu.__path__ = []
    root = _module(ROOT, {
        "__version__": VERSION, "_SLIME_ASCEND_EMULATED": True, "npu": npu,
        "_apply_patches": _apply_patches, "version": types.SimpleNamespace(__version__=VERSION),
    }, package=True)
    contrib = _module("torch_npu.contrib", package=True)
    distributed = _module("torch_npu.distributed", {"is_hccl_available": hccl.is_hccl_available,
                                                    "is_available": lambda: True}, package=True)
    utils = _module("torch_npu.utils", package=True)
    reductions = _module("torch_npu.multiprocessing.reductions", {
        "__all__": ["rebuild_npu_event", "rebuild_npu_tensor"], "rebuild_npu_event": _rebuild_npu_ipc,
        "rebuild_npu_tensor": _rebuild_npu_ipc})
    multiprocessing = _module("torch_npu.multiprocessing", {"reductions": reductions}, package=True)
    root.contrib, root.distributed, root.utils, root.multiprocessing = contrib, distributed, utils, multiprocessing
    modules = {ROOT: root, "torch_npu.npu": npu, "torch_npu.contrib": contrib,
               "torch_npu.distributed": distributed, "torch_npu.utils": utils,
               "torch_npu.multiprocessing": multiprocessing, "torch_npu.multiprocessing.reductions": reductions}
    for name, sub in npu_module.SUBMODULES.items():
        modules[f"torch_npu.npu.{name}"] = sub
    for name, module in modules.items():
        sys.modules[name] = module
    sys.modules.setdefault("torch.npu", npu)
    for name in ("memory", "amp", "random", "streams", "utils"):
        setattr(npu, name, npu_module.SUBMODULES[name])
    return root


def _rebuild_npu_ipc(*args, **kwargs):
    """``torch_npu.multiprocessing.reductions.rebuild_npu_tensor`` / ``rebuild_npu_event`` (Ascend/pytorch
    ``torch_npu/multiprocessing/reductions.py``): SGLang's ``patch_torch`` imports the module and wraps the first at
    import. Rebuilding an NPU tensor or event from another process's IPC handle is not emulated (emulated ``npu``
    tensors cross processes by pickling their host data); a call says so in one line."""
    raise RuntimeError("torch_npu.multiprocessing.reductions: sharing npu tensors and events between processes by "
                       "IPC handle is not emulated (the emulated device's tensors pickle their host data)")


def _apply_patches(monkey_patches) -> None:
    """torch_npu's ``_apply_patches`` (``torch_npu/_init/patches``): ``[dest, patch]`` pairs under ``torch``; a
    module patch with ``__all__`` copies those names onto the existing destination module."""
    import torch

    def resolve(parts, root=torch):
        if len(parts) <= 1:
            return root
        if not hasattr(root, parts[0]):
            name = f"{root.__name__}.{parts[0]}"
            sys.modules[name] = types.ModuleType(name)
            setattr(root, parts[0], sys.modules[name])
        return resolve(parts[1:], getattr(root, parts[0]))

    for dest, patch in monkey_patches:
        parts = dest.split(".")
        owner, last = resolve(parts), parts[-1]
        if not isinstance(patch, types.ModuleType):
            setattr(owner, last, patch)
            continue
        if not hasattr(owner, last) or not hasattr(patch, "__all__"):
            setattr(owner, last, patch)
            sys.modules[f"{owner.__name__}.{last}"] = patch
            continue
        target = getattr(owner, last)
        for attribute in patch.__all__:
            setattr(target, attribute, getattr(patch, attribute))


class _Loader(importlib.abc.Loader):
    """Loads the emulated modules: ``torch_npu`` (installing the emulation), ``transfer_to_npu`` (applying it)
    and, when asked for, ``torch_memory_saver``."""

    def create_module(self, spec):
        if spec.name == MEMORY_SAVER:
            _installer(memory_saver=True)
            return sys.modules[MEMORY_SAVER]
        _installer(memory_saver=_armed["memory_saver"])
        if spec.name == TRANSFER:
            from . import transfer_to_npu

            transfer_to_npu.apply()
            module = _module(TRANSFER, {"__all__": []})
            sys.modules[TRANSFER] = module
            sys.modules["torch_npu.contrib"].transfer_to_npu = module
            return module
        module = sys.modules.get(spec.name)
        if module is None:
            raise ModuleNotFoundError(f"No module named {spec.name!r} (not provided by the npu emulation)",
                                      name=spec.name)
        return module

    def exec_module(self, module) -> None:
        return None


_LOADER = _Loader()


class EmulatedFinder(importlib.abc.MetaPathFinder):
    """Answers for ``torch_npu`` (and ``torch_npu.contrib.transfer_to_npu``; ``torch_memory_saver`` when armed
    with it) once the emulation is armed or installed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == ROOT or fullname == TRANSFER:
            return importlib.machinery.ModuleSpec(fullname, _LOADER, is_package=fullname == ROOT)
        if fullname == MEMORY_SAVER and _armed["memory_saver"]:
            return importlib.machinery.ModuleSpec(fullname, _LOADER, is_package=True)
        return None


_FINDER = EmulatedFinder()


def add_finder() -> None:
    with _lock:
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)


def arm(*, memory_saver: bool = False) -> None:
    """Make ``torch_npu`` findable now and install the emulation when torch is imported (now, if it is)."""
    from .. import _import_hooks

    with _lock:
        _armed["memory_saver"] = _armed["memory_saver"] or memory_saver
    add_finder()

    def on_torch(_module) -> None:
        _installer(memory_saver=_armed["memory_saver"])

    _import_hooks.when_imported("torch", on_torch)

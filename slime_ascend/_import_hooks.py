"""Run code right before or right after a named module is first imported.

slime selects its accelerator and builds Ray resources when its modules are imported, and
MindSpeed must be imported before Megatron. The bootstrap therefore cannot wait for a slime hook:
it registers callbacks here, and a meta-path finder runs them at the right moment in whatever
process imports the module (driver, Ray worker, spawned engine). A module already imported gets
its after-import callbacks immediately.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

_lock = threading.RLock()
_after: dict[str, list[Callable[[ModuleType], None]]] = {}
_before: dict[str, list[Callable[[], None]]] = {}
_resolving = threading.local()


def module_file(module_name: str) -> Path | None:
    """The source file of ``module_name`` without importing it (its parent packages are imported); None when
    it cannot be found or is not a plain file."""
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        return None
    return Path(spec.origin)


def when_imported(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once ``module_name`` is imported (now, if it already is)."""
    with _lock:
        module = sys.modules.get(module_name)
        if module is None:
            _after.setdefault(module_name, []).append(callback)
            _install()
            return
    callback(module)


def before_import(module_name: str, callback: Callable[[], None]) -> bool:
    """Call ``callback()`` right before ``module_name`` is first imported.

    Returns False (and does nothing) when the module is already imported: too late.
    """
    with _lock:
        if module_name in sys.modules:
            return False
        _before.setdefault(module_name, []).append(callback)
        _install()
        return True


def pending() -> dict[str, int]:
    """Module name -> number of callbacks still waiting (for ``doctor`` and tests)."""
    with _lock:
        names = set(_after) | set(_before)
        return {n: len(_after.get(n, ())) + len(_before.get(n, ())) for n in sorted(names)}


def clear(module_name: str | None = None) -> None:
    """Forget waiting callbacks (tests)."""
    with _lock:
        if module_name is None:
            _after.clear()
            _before.clear()
        else:
            _after.pop(module_name, None)
            _before.pop(module_name, None)


class _Loader(importlib.abc.Loader):
    """Wraps the real loader: before-callbacks run in create_module, after-callbacks after exec.

    A before-callback may itself import the module (an adaptor that imports what it patches);
    then that module object is returned and not executed a second time.
    """

    def __init__(self, name: str, wrapped: importlib.abc.Loader):
        self._name = name
        self._wrapped = wrapped
        self._preloaded: ModuleType | None = None

    def create_module(self, spec):
        with _lock:
            befores = _before.pop(self._name, [])
        for callback in befores:
            callback()
        if self._name in sys.modules:
            self._preloaded = sys.modules[self._name]
            return self._preloaded
        return self._wrapped.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if module is not self._preloaded:
            self._wrapped.exec_module(module)
        with _lock:
            callbacks = _after.pop(self._name, [])
        for callback in callbacks:
            callback(module)

    def __getattr__(self, item):  # get_source, get_filename, is_package, ... for tools that ask
        return getattr(self._wrapped, item)


class _NamespaceLoader(importlib.abc.Loader):
    """What the import system does for a namespace package: the default module, nothing to execute (its
    ``__path__`` comes from the spec)."""

    def create_module(self, spec):
        return None

    def exec_module(self, module: ModuleType) -> None:
        pass

    def is_package(self, fullname: str) -> bool:
        return True


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        with _lock:
            interested = fullname in _after or fullname in _before
        if not interested or getattr(_resolving, "active", False):
            return None
        _resolving.active = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            _resolving.active = False
        if spec is None:
            return spec
        if spec.loader is None and spec.submodule_search_locations is not None:
            # a namespace package (megatron-core's ``megatron``: no __init__.py) has no loader to wrap, and the
            # import system makes its module itself: give it one that creates nothing and executes nothing
            spec.loader = _Loader(fullname, _NamespaceLoader())
            return spec
        if spec.loader is None:
            return spec
        spec.loader = _Loader(fullname, spec.loader)
        return spec


_FINDER = _Finder()


def _install() -> None:
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)

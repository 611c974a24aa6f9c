"""Runtime patches: declared, target-checked, stackable and removable.

A :class:`RuntimePatch` names one concept (e.g. "Ray asks for NPU, not GPU"), the modules it
changes, why, how, the upstream patch in ``patches/`` that would retire it, and the slime
versions it was checked on. Before changing anything it checks that each target still has the
expected shape (:meth:`RuntimePatch.check`); a mismatch raises :class:`PatchTargetError` naming
the running slime version. Nothing is half-applied.

Attribute changes go through :class:`AttributeStack`: per ``(object, attribute)`` it keeps the
original, at most one replacement and any number of wrappers, and rebuilds the value from them
on every change. Wrappers from several patches therefore stack in application order, two
replacements of one attribute conflict loudly, and any patch can be removed again in any order.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import logging
import re
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

logger = logging.getLogger("slime_ascend.patch")


class PatchError(RuntimeError):
    pass


class PatchTargetError(PatchError):
    """The patch target no longer looks as the patch expects; nothing was changed."""


class PatchConflictError(PatchError):
    """Two patches replace the same attribute."""


def slime_version() -> str:
    """Version of the slime that ``import slime`` finds: its ``setup.py`` next to the package
    (source checkouts, the usual install), else its distribution metadata; "absent" if none."""
    spec = importlib.util.find_spec("slime")
    if spec is None or not spec.submodule_search_locations:
        return "absent"
    root = Path(next(iter(spec.submodule_search_locations))).parent
    setup = root / "setup.py"
    if setup.is_file():
        match = re.search(r"version\s*=\s*[\"']([^\"']+)[\"']", setup.read_text(errors="replace"))
        if match:
            return match.group(1)
    try:
        from importlib.metadata import version

        return version("slime")
    except Exception:  # noqa: BLE001
        return "unknown"


_MISSING = object()


class AttributeStack:
    """Original value + optional replacement + wrappers of one attribute, rebuilt on change."""

    _lock = threading.RLock()
    _stacks: dict[tuple[int, str], "AttributeStack"] = {}

    def __init__(self, owner: Any, attr: str):
        self.owner = owner
        self.attr = attr
        self.original = getattr(owner, attr, _MISSING)
        self.replacement: tuple[str, Any] | None = None
        self.wrappers: list[tuple[str, Callable[[Any], Any]]] = []

    @classmethod
    def of(cls, owner: Any, attr: str) -> "AttributeStack":
        with cls._lock:
            key = (id(owner), attr)
            stack = cls._stacks.get(key)
            if stack is None or stack.owner is not owner:
                stack = cls._stacks[key] = AttributeStack(owner, attr)
            return stack

    def _rebuild(self) -> None:
        value = self.replacement[1] if self.replacement else self.original
        for _, wrap in self.wrappers:
            value = wrap(value)
        if value is _MISSING:
            if hasattr(self.owner, self.attr):
                delattr(self.owner, self.attr)
        else:
            setattr(self.owner, self.attr, value)
        if self.replacement is None and not self.wrappers:
            with self._lock:
                self._stacks.pop((id(self.owner), self.attr), None)

    def replace(self, patch_id: str, value: Any) -> None:
        with self._lock:
            if self.replacement is not None and self.replacement[0] != patch_id:
                raise PatchConflictError(
                    f"patches {self.replacement[0]!r} and {patch_id!r} both replace "
                    f"{_name(self.owner)}.{self.attr}; only one replacement per attribute is allowed"
                )
            self.replacement = (patch_id, value)
            self._rebuild()

    def wrap(self, patch_id: str, wrapper: Callable[[Any], Any]) -> None:
        with self._lock:
            self.wrappers = [w for w in self.wrappers if w[0] != patch_id] + [(patch_id, wrapper)]
            self._rebuild()

    def remove(self, patch_id: str) -> None:
        with self._lock:
            if self.replacement and self.replacement[0] == patch_id:
                self.replacement = None
            self.wrappers = [w for w in self.wrappers if w[0] != patch_id]
            self._rebuild()

    @classmethod
    def owned_by(cls, patch_id: str) -> list["AttributeStack"]:
        with cls._lock:
            return [
                s
                for s in cls._stacks.values()
                if (s.replacement and s.replacement[0] == patch_id) or any(w[0] == patch_id for w in s.wrappers)
            ]


def _name(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or type(owner).__name__


@dataclasses.dataclass
class RuntimePatch:
    """One runtime patch. Subclasses implement :meth:`check` and :meth:`apply`."""

    id: str  # "<process>.<name>", e.g. "driver.ray_npu_resources"
    targets: tuple[str, ...]  # modules (and attributes) it changes, "module:attr"
    why: str
    how: str
    upstream: str  # file in patches/ whose merge retires this patch
    checked_on: tuple[str, ...]  # slime versions
    process: str = ""

    def __post_init__(self) -> None:
        self.process = self.id.split(".", 1)[0]
        if self.process not in ("driver", "train", "rollout", "engine"):
            raise ValueError(f"patch id {self.id!r} must start with driver., train., rollout. or engine.")

    # -- what subclasses implement -------------------------------------------------------
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        """Problems with the targets' shape (empty: looks as expected)."""
        return []

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        raise NotImplementedError

    # -- helpers for subclasses ----------------------------------------------------------
    def replace(self, owner: Any, attr: str, value: Any) -> None:
        AttributeStack.of(owner, attr).replace(self.id, value)

    def wrap(self, owner: Any, attr: str, wrapper: Callable[[Any], Any]) -> None:
        AttributeStack.of(owner, attr).wrap(self.id, wrapper)

    # -- lifecycle -----------------------------------------------------------------------
    #: modules the process must have loaded for :meth:`check` to mean anything (e.g. ``torch_npu``: the patch
    #: runs only where the device runtime is up); where one is not, this host cannot check the patch
    needs_loaded: tuple[str, ...] = ()

    def not_checkable(self) -> str | None:
        """Why this host cannot check the targets at all (the package they live in is not importable, or a module
        in :attr:`needs_loaded` is not loaded), else None. Finds, never imports: ``slime-ascend doctor`` reports
        these as not checked, not as failures."""
        import sys

        from ..host import module_installed as _findable

        for package in dict.fromkeys(name.split(".", 1)[0] for name in self.target_modules):
            if not _findable(package):
                return f"{package} is not importable"
        for name in self.needs_loaded:
            if name not in sys.modules or sys.modules[name] is None:
                return (f"{name} is not loaded in this process" if _findable(name)
                        else f"{name} is not installed (not an Ascend host)" if name == "torch_npu"
                        else f"{name} is not installed")
        return None

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.split(":", 1)[0] for t in self.targets))

    def load_targets(self) -> dict[str, ModuleType]:
        return {name: importlib.import_module(name) for name in self.target_modules}

    def verify(self, modules: dict[str, ModuleType] | None = None) -> list[str]:
        """Check the targets without changing them; returns problems (imports the targets)."""
        try:
            modules = self.load_targets() if modules is None else modules
        except ImportError as exc:
            return [f"cannot import target: {exc}"]
        return self.check(modules)

    def install(self, args: Any = None, modules: dict[str, ModuleType] | None = None) -> None:
        modules = self.load_targets() if modules is None else modules
        problems = self.check(modules)
        if problems:
            raise PatchTargetError(
                f"runtime patch {self.id!r} was not applied: its target no longer looks as expected "
                f"({'; '.join(problems)}). Checked on slime {', '.join(self.checked_on)}; running slime "
                f"{slime_version()}. Fix: use a checked slime version, or upgrade slime-ascend; the upstream "
                f"change {self.upstream} would make this patch unnecessary."
            )
        self.apply(modules, args)
        logger.info("applied runtime patch %s", self.id)

    @property
    def applied(self) -> bool:
        return bool(AttributeStack.owned_by(self.id))

    def remove(self) -> None:
        for stack in AttributeStack.owned_by(self.id):
            stack.remove(self.id)


# -- shape checks shared by patches ------------------------------------------------------------
def missing_attrs(module: ModuleType, names: Iterable[str]) -> list[str]:
    return [f"{module.__name__}.{n} is missing" for n in names if _get(module, n) is _MISSING]


def missing_source(obj: Any, snippets: Iterable[str], label: str | None = None) -> list[str]:
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError) as exc:
        return [f"source of {label or _name(obj)} unavailable ({exc})"]
    return [f"{label or _name(obj)} no longer contains {s!r}" for s in snippets if s not in source]


def param_mismatch(func: Callable[..., Any], expected: Iterable[str], label: str | None = None) -> list[str]:
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError) as exc:
        return [f"signature of {label or _name(func)} unavailable ({exc})"]
    expected = list(expected)
    if names[: len(expected)] != expected:
        return [f"{label or _name(func)} takes {names}, expected it to start with {expected}"]
    return []


def method_mismatch(module: ModuleType, dotted: str, params: Iterable[str], snippets: Iterable[str] = (),
                    unwrap: bool = False) -> list[str]:
    """The checks of a patch on one method (``dotted``: ``"Class.method"`` in ``module``): it exists, its
    parameters start with ``params`` and its source holds ``snippets``. ``unwrap`` looks through an earlier
    patch's wrapper (``__wrapped__``) at slime's own function."""
    method = _get(module, dotted)
    if method is _MISSING:
        return [f"{module.__name__}.{dotted} is missing"]
    if unwrap:
        method = getattr(method, "__wrapped__", method)
    return param_mismatch(method, params, dotted) + missing_source(method, snippets, dotted)


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            return _MISSING
    return obj

"""The Plugin base: what a plugin declares. Declarations only; nothing heavy is imported here.

A plugin object is cheap to build and to load from its entry point: contributions and
process-start actions are dotted paths, resolved only when they run.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

from .settings import Setting
from .slots import get_slot


def resolve(path: str) -> Any:
    """Import ``package.module.attr`` (or ``package.module:attr``) and return the attribute."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not a dotted path of the form package.module.attr")
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AttributeError(f"{path!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


@dataclasses.dataclass(frozen=True)
class Contribution:
    """A plugin's function for one slime hook slot.

    ``order`` places it within a chain slot (lower runs first); see :mod:`slots`.
    """

    slot: str
    target: str  # dotted path of the function
    order: int = 500
    note: str = ""

    def __post_init__(self) -> None:
        get_slot(self.slot)  # unknown slot: fail at declaration

    def load(self) -> Callable[..., Any]:
        return resolve(self.target)


@dataclasses.dataclass(frozen=True)
class CommandLineFlag:
    """A flag slime must get on its command line (it derives other settings from it before the
    YAML is applied). ``check(args)`` returns None when the running args satisfy it."""

    flag: str
    why: str
    check: Callable[[Any], bool] | None = None


@dataclasses.dataclass(frozen=True)
class Plugin:
    name: str
    description: str
    requires: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    settings: tuple[Setting, ...] = ()
    contributions: tuple[Contribution, ...] = ()
    # Dotted paths of callables run once per process at interpreter start (bootstrap).
    process_start: tuple[str, ...] = ()
    # Ids of runtime patches in the ledger (slime_ascend.patch) this plugin needs.
    patches: tuple[str, ...] = ()
    # Extra slime args the generated YAML sets (plain slime keys, e.g. loss_type: custom_loss).
    slime_args: tuple[tuple[str, Any], ...] = ()
    command_line: tuple[CommandLineFlag, ...] = ()
    # Called with (args, settings_view) at first use in each process; raises SettingsError.
    validate: str | None = None

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip().lower() or " " in self.name:
            raise ValueError(f"plugin name {self.name!r} must be a lower-case word (dashes allowed)")
        keys = [s.key for s in self.settings]
        if len(keys) != len(set(keys)):
            raise ValueError(f"plugin {self.name!r} declares a setting twice: {keys}")
        if self.name in self.requires or self.name in self.conflicts:
            raise ValueError(f"plugin {self.name!r} cannot require or conflict with itself")

"""The Plugin base: what a plugin declares. Declarations only; nothing heavy is imported here.

A plugin object is cheap to build and to load from its entry point: contributions and
process-start actions are dotted paths, resolved only when they run.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import shlex
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


# A word of a CommandLineFlag the user must replace: HOST:PORT, DIR, N ... ("..." = repeat the value).
_PLACEHOLDER = re.compile(r"^(\.\.\.|[A-Z][A-Z0-9_]*(:[A-Z][A-Z0-9_]*)*)$")


@dataclasses.dataclass(frozen=True)
class CommandLineFlag:
    """A flag slime must get on its command line (it derives other settings from it before the
    YAML is applied). ``check(args)`` returns True when the running args satisfy it.

    ``flag`` is written as on a shell command line. Values only the user knows are written in
    capitals (``--update-weight-disk-dir DIR``, ``HOST:PORT ...``); text that does not start with
    ``-`` is advice (e.g. ``train_async.py ...``). Neither is printed by ``slime-ascend config --flags``.
    """

    flag: str
    why: str
    check: Callable[[Any], bool] | None = None

    def split(self) -> tuple[list[str], str | None]:
        """``(words, manual)``: the options that can be pasted as is, as command-line words, and the
        rest (advice, or options with a value only the user knows) as text, None when nothing is left."""
        words = shlex.split(self.flag)
        if not words or not _is_option(words[0]):
            return [], self.flag
        groups: list[list[str]] = []
        for word in words:
            if _is_option(word):
                groups.append([word])
            else:
                groups[-1].append(word)
        ready = [g for g in groups if not any(_PLACEHOLDER.match(w) for w in g[1:])]
        manual = [g for g in groups if g not in ready]
        return [w for g in ready for w in g], (shlex.join(w for g in manual for w in g) if manual else None)


def _is_option(word: str) -> bool:
    return len(word) > 1 and word[0] == "-" and not word[1].isdigit() and word[1] != "."


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

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


#: When the runtime installs a declared patch (see :mod:`slime_ascend.startup.patch_plan`).
PATCH_MOMENTS = ("import", "train", "rollout")


@dataclasses.dataclass(frozen=True)
class PatchUse:
    """A runtime patch (an id in :data:`slime_ascend.patch.LEDGER`) a plugin needs, and when.

    ``moment``:

    - ``"import"``: in every process, as each target module is imported (from the bootstrap);
      ``"import:<module>"``: in every process, all targets at once, when ``<module>`` is imported;
    - ``"train"``: in each train actor, with its ``args``, as slime's ``TrainRayActor.init`` starts;
    - ``"rollout"``: in the RolloutManager, with its ``args``, as it starts.

    ``when``: dotted path of a predicate (``fn()`` for import moments, ``fn(args)`` otherwise); the patch
    is installed only where it returns true (a tuple: where any returns true; the plan combines two plugins'
    declarations of one patch so). ``after``: ledger ids that must be installed before this
    one when both are (their wrappers stack in that order); install order is the ledger's.
    """

    patch: str
    moment: str = "import"
    when: str | tuple[str, ...] | None = None
    after: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        base, sep, module = self.moment.partition(":")
        if base not in PATCH_MOMENTS or (sep and (base != "import" or not module)):
            raise ValueError(f"patch {self.patch!r}: moment {self.moment!r} is not one of "
                             "import, import:<module>, train, rollout")

    @property
    def trigger(self) -> str | None:
        """The module whose import installs it (``import:<module>``), None for the targets' own imports."""
        return self.moment.partition(":")[2] or None

    @property
    def role(self) -> str | None:
        """``train`` / ``rollout`` for role moments, None for import moments."""
        return None if self.moment.startswith("import") else self.moment


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
        groups = option_groups(words)
        ready = [g for g in groups if not any(_PLACEHOLDER.match(w) for w in g[1:])]
        manual = [g for g in groups if g not in ready]
        return [w for g in ready for w in g], (shlex.join(w for g in manual for w in g) if manual else None)


def _is_option(word: str) -> bool:
    return len(word) > 1 and word[0] == "-" and not word[1].isdigit() and word[1] != "."


def option_groups(words: list[str]) -> list[list[str]]:
    """Command-line words that start with an option, as ``[option, *its values]`` groups."""
    groups: list[list[str]] = []
    for word in words:
        if _is_option(word):
            groups.append([word])
        else:
            groups[-1].append(word)
    return groups


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
    # Runtime patches (ledger ids) this plugin needs and when; the runtime installs them (a bare id: at import).
    patches: tuple[PatchUse | str, ...] = ()
    # Extra slime args the generated YAML sets (plain slime keys, e.g. loss_type: custom_loss).
    slime_args: tuple[tuple[str, Any], ...] = ()
    command_line: tuple[CommandLineFlag, ...] = ()
    # Called with (args, settings_view) at first use in each process; raises SettingsError.
    validate: str | None = None
    # Files `slime-ascend config -o FILE` writes beside the YAML: (file name, dotted path of
    # ``fn(path, settings: dict, force: bool)``); a command-line flag naming the file gets its path.
    config_files: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip().lower() or " " in self.name:
            raise ValueError(f"plugin name {self.name!r} must be a lower-case word (dashes allowed)")
        keys = [s.key for s in self.settings]
        if len(keys) != len(set(keys)):
            raise ValueError(f"plugin {self.name!r} declares a setting twice: {keys}")
        if self.name in self.requires or self.name in self.conflicts:
            raise ValueError(f"plugin {self.name!r} cannot require or conflict with itself")
        uses = tuple(u if isinstance(u, PatchUse) else PatchUse(u) for u in self.patches)
        ids = [u.patch for u in uses]
        if len(ids) != len(set(ids)):
            raise ValueError(f"plugin {self.name!r} declares a patch twice: {ids}")
        object.__setattr__(self, "patches", uses)

    @property
    def patch_ids(self) -> tuple[str, ...]:
        return tuple(u.patch for u in self.patches)

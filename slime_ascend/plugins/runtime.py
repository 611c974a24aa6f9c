"""The plugins active in this process, validated once against slime's real ``args``.

Which plugins are on: ``args.ascend_plugins`` (written by ``slime-ascend config`` into the YAML,
pickled into every Ray actor with ``args``) when present, else ``SLIME_ASCEND_PLUGINS``. When
both are set they must agree: the bootstrap (environment) and the dispatchers (args) would
otherwise run different plugins in the same job.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

from . import registry
from .base import resolve
from .registry import PluginError, Selection
from .settings import PREFIX, SettingsError, SettingsView, read

logger = logging.getLogger("slime_ascend")

ENV = "SLIME_ASCEND_PLUGINS"
ARGS_KEY = "ascend_plugins"


@dataclasses.dataclass
class Active:
    selection: Selection
    settings: dict[str, SettingsView]


_lock = threading.Lock()
# (id(args), plugin names) -> (args, its validation). Each entry holds its args, so an id is not reused
# while cached; bounded, since a caller may copy args per step (the oldest entries are validated again).
_validated: OrderedDict[tuple[int, tuple[str, ...]], tuple[Any, Active]] = OrderedDict()
_MAX_VALIDATED = 64


# Set while `slime-ascend config` checks the YAML it is about to write: the shell's environment
# belongs to whatever job runs later, not to that check.
_ignore_env: contextvars.ContextVar[bool] = contextvars.ContextVar("slime_ascend_ignore_env", default=False)


@contextlib.contextmanager
def ignoring_environment() -> Iterator[None]:
    token = _ignore_env.set(True)
    try:
        yield
    finally:
        _ignore_env.reset(token)


def environ() -> Mapping[str, str]:
    """The process environment a plugin's check reads: empty while `slime-ascend config` checks a YAML
    (:func:`ignoring_environment`), whose job runs later elsewhere."""
    return {} if _ignore_env.get() else os.environ


def enabled_names(args: Any = None) -> list[str]:
    from_args = getattr(args, ARGS_KEY, None) if args is not None else None
    from_env = None if _ignore_env.get() else os.environ.get(ENV)
    if from_args is not None:
        names = registry.parse_names(from_args)
        if from_env and registry.parse_names(from_env) != names:
            raise PluginError(
                f"{ENV}={from_env!r} disagrees with {ARGS_KEY}={names!r} from the YAML given to "
                f"--custom-config-path. Fix: export {ENV}={','.join(names)} (the value `slime-ascend config` "
                "printed) in the environment of the driver and of `ray start`."
            )
        return names
    return registry.parse_names(from_env)


def settings_values(plugin, args: Any) -> dict[str, Any]:
    return {s.key: read(s, args) for s in plugin.settings}


def check_keys(args: Any, selection: Selection) -> None:
    """Refuse an ``ascend_*`` key on ``args`` that no installed plugin declares (a misspelling would
    otherwise leave the setting silently at its default); the error names the closest real key."""
    try:
        present = [k for k in vars(args) if isinstance(k, str) and k.startswith(PREFIX)]
    except TypeError:  # args without __dict__: nothing to scan
        return
    # every setting key of every installed plugin -> the plugin that declares it
    known = {ARGS_KEY: "-", **{s.key: p.name for p in registry.available().values() for s in p.settings}}
    for key in sorted(present):
        owner = known.get(key)
        if owner is None:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            broken = registry.broken()
            if broken:
                hint += f"(plugins that failed to load, whose keys are unknown here: {', '.join(sorted(broken))}) "
            raise SettingsError(
                f"unknown setting {key!r} in the YAML given to --custom-config-path: no installed plugin declares "
                f"it; {hint}Fix: correct the key, or remove it (`slime-ascend plugins` lists each plugin's settings)"
            )
        if owner != "-" and owner not in selection.names:
            logger.warning("setting %s belongs to plugin %r, which is not enabled: it has no effect", key, owner)


def check(args: Any, names: list[str] | None = None, *, command_line: bool = True) -> Active:
    """Validate the enabled plugins (``names``, default: :func:`enabled_names`) against ``args``.

    Checks, in order: the selection (unknown/broken plugins, conflicts, slot clashes), that every
    ``ascend_*`` key is a declared setting, every setting's value, the flags plugins need on slime's
    command line (unless ``command_line`` is false), and each plugin's own ``validate``. Raises
    :class:`PluginError` or :class:`SettingsError`; caches nothing (see :func:`active`).
    """
    names = enabled_names(args) if names is None else list(names)
    selection = registry.resolve_selection(names)
    check_keys(args, selection)
    views = {plugin.name: SettingsView(plugin.name, settings_values(plugin, args)) for plugin in selection.plugins}
    for plugin in selection.plugins:
        if command_line:
            for flag in plugin.command_line:
                if flag.check is not None and not flag.check(args):
                    raise SettingsError(
                        f"plugin {plugin.name!r} needs `{flag.flag}` on slime's command line ({flag.why}). "
                        "Fix: add it to the launch command; the YAML cannot set it because slime derives other "
                        "settings from it before the YAML is applied."
                    )
        if plugin.validate:
            resolve(plugin.validate)(args, views[plugin.name])
    return Active(selection, views)


def active(args: Any) -> Active:
    """Resolve and validate the enabled plugins against ``args`` (once per ``args`` object and selection:
    two roles of one process, e.g. slime's actor and critic args, each get their own values)."""
    names = tuple(enabled_names(args))
    key = (id(args), names)
    with _lock:
        cached = _validated.get(key)
    if cached is not None and cached[0] is args:
        return cached[1]
    result = check(args, list(names))
    with _lock:
        first = all(k[1] != names for k in _validated)
        _validated[key] = (args, result)
        while len(_validated) > _MAX_VALIDATED:
            _validated.popitem(last=False)
    if first:
        logger.info("slime-ascend plugins active: %s", ", ".join(result.selection.names) or "none")
    return result


def settings(args: Any, plugin_name: str) -> SettingsView:
    """Validated settings of one plugin. The plugin need not be enabled (defaults then apply)."""
    state = active(args)
    if plugin_name in state.settings:
        return state.settings[plugin_name]
    plugin = registry.available()[plugin_name]
    return SettingsView(plugin.name, settings_values(plugin, args))


# -- the process-start activation's failure (slime_ascend.startup.bootstrap keeps it; the first validation point
# or hook dispatcher call raises it) ---------------------------------------------------------------------
_activation_error: BaseException | None = None


def keep_activation_error(exc: BaseException) -> None:
    global _activation_error
    _activation_error = exc


def activation_error() -> BaseException | None:
    return _activation_error


def raise_activation_error(where: str = "") -> None:
    """Raise the kept process-start failure as a PluginError (the first validation point or hook call does)."""
    if _activation_error is not None:
        raise PluginError(f"slime-ascend failed to activate at process start{where} "
                          f"({type(_activation_error).__name__}: {_activation_error})") from _activation_error


def reset() -> None:
    """Forget validations and the train role (tests)."""
    from . import roles

    with _lock:
        _validated.clear()
    roles.set_train_role(None)

"""The plugins active in this process, validated once against slime's real ``args``.

Which plugins are on: ``args.ascend_plugins`` (written by ``slime-ascend config`` into the YAML,
pickled into every Ray actor with ``args``) when present, else ``SLIME_ASCEND_PLUGINS``. When
both are set they must agree: the bootstrap (environment) and the dispatchers (args) would
otherwise run different plugins in the same job.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any

from . import registry
from .base import resolve
from .registry import PluginError, Selection
from .settings import SettingsError, SettingsView, coerce

logger = logging.getLogger("slime_ascend")

ENV = "SLIME_ASCEND_PLUGINS"
ARGS_KEY = "ascend_plugins"


@dataclasses.dataclass
class Active:
    selection: Selection
    settings: dict[str, SettingsView]


_lock = threading.Lock()
_validated: dict[tuple[str, ...], Active] = {}


def enabled_names(args: Any = None) -> list[str]:
    from_args = getattr(args, ARGS_KEY, None) if args is not None else None
    from_env = os.environ.get(ENV)
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


def selection_for(names: list[str]) -> Selection:
    return registry.resolve_selection(names)


def settings_values(plugin, args: Any) -> dict[str, Any]:
    return {s.key: coerce(s, getattr(args, s.key, s.default)) for s in plugin.settings}


def active(args: Any) -> Active:
    """Resolve and validate the enabled plugins against ``args`` (once per process and selection)."""
    names = tuple(enabled_names(args))
    with _lock:
        cached = _validated.get(names)
    if cached is not None:
        return cached
    selection = selection_for(list(names))
    views: dict[str, SettingsView] = {}
    for plugin in selection.plugins:
        views[plugin.name] = SettingsView(plugin.name, settings_values(plugin, args))
        for flag in plugin.command_line:
            if flag.check is not None and not flag.check(args):
                raise SettingsError(
                    f"plugin {plugin.name!r} needs `{flag.flag}` on slime's command line ({flag.why}). "
                    "Fix: add it to the launch command; the YAML cannot set it because slime derives other "
                    "settings from it before the YAML is applied."
                )
        if plugin.validate:
            resolve(plugin.validate)(args, views[plugin.name])
    result = Active(selection, views)
    with _lock:
        _validated[names] = result
    logger.info("slime-ascend plugins active: %s", ", ".join(selection.names) or "none")
    return result


def settings(args: Any, plugin_name: str) -> SettingsView:
    """Validated settings of one plugin. The plugin need not be enabled (defaults then apply)."""
    state = active(args)
    if plugin_name in state.settings:
        return state.settings[plugin_name]
    plugin = registry.available()[plugin_name]
    return SettingsView(plugin.name, settings_values(plugin, args))


def reset() -> None:
    """Forget validations (tests)."""
    with _lock:
        _validated.clear()

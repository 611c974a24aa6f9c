"""Discovering plugins (entry-point group ``slime_ascend.plugins``) and resolving a selection.

Entry points are loaded once, on first use. One that fails to load, is not a :class:`Plugin`, or is
named differently from its entry point is reported by :func:`broken` and refused by name; it does not
take the others down. Plugins can also be registered directly (tests, code that ships no entry point).

:func:`resolve_selection` turns the names a user enabled into a :class:`Selection`: the plugins
with their requirements added, conflicts and slot clashes rejected, and for every hook slot the
ordered list of contributions its dispatcher runs.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable
from importlib.metadata import entry_points

from ..command import UserError
from .base import Contribution, Plugin
from .slots import SLOTS

GROUP = "slime_ascend.plugins"


class PluginError(UserError, RuntimeError):
    """A plugin selection cannot be used as given; the message says why and what to change."""


_lock = threading.Lock()
_cache: dict[str, Plugin] | None = None  # the installed entry points, loaded on first use
_broken: dict[str, str] = {}
_extra: dict[str, Plugin] = {}  # registered directly; test helpers save and restore it


def register(plugin: Plugin) -> None:
    """Register a plugin object directly (tests, and code that cannot ship an entry point)."""
    with _lock:
        _extra[plugin.name] = plugin


def available() -> dict[str, Plugin]:
    """All known plugins by name: entry points of every installed distribution, plus registered ones.

    A plugin that fails to load is reported (:func:`broken`) and refused by name; it does not take
    the others down."""
    global _cache
    with _lock:
        if _cache is None:
            found: dict[str, Plugin] = {}
            for ep in entry_points(group=GROUP):
                try:
                    obj = ep.load()
                except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported by broken(), not fatal
                    # (SystemExit: a plugin module that runs argparse or sys.exit at import)
                    _broken[ep.name] = f"entry point {ep.value} failed to load: {type(exc).__name__}: {exc}"
                    continue
                if not isinstance(obj, Plugin):
                    _broken[ep.name] = f"entry point {ep.value} is not a Plugin"
                elif obj.name != ep.name:
                    _broken[ep.name] = f"entry point {ep.value} loads a plugin named {obj.name!r}"
                elif obj.name in found:
                    _broken[ep.name] = "two installed distributions provide this plugin"
                    found.pop(obj.name)
                else:
                    found[obj.name] = obj
            _cache = found
        return {**_cache, **_extra}


def broken() -> dict[str, str]:
    """Installed plugins that could not be loaded, with the reason."""
    available()
    return dict(_broken)


def parse_names(text: str | Iterable[str] | None) -> list[str]:
    """``"npu, sao"`` or ``["npu", "sao"]`` -> ``["npu", "sao"]``; ``"all"`` is kept as is."""
    if text is None:
        return []
    items = [text] if isinstance(text, str) else list(text)
    names = (part.strip().lower() for item in items for part in str(item).split(","))
    return list(dict.fromkeys(name for name in names if name))


@dataclasses.dataclass(frozen=True)
class Selection:
    plugins: tuple[Plugin, ...]
    # slot name -> [(plugin name, contribution)] in the order the dispatcher runs them
    slots: dict[str, tuple[tuple[str, Contribution], ...]]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.plugins)

    def get(self, name: str) -> Plugin:
        for plugin in self.plugins:
            if plugin.name == name:
                return plugin
        raise KeyError(name)


def resolve_selection(names: Iterable[str], known: dict[str, Plugin] | None = None) -> Selection:
    known = available() if known is None else known
    requested = parse_names(names)
    if "all" in requested:
        # every plugin that is not one of a set of alternatives (declares no conflicts)
        requested = [n for n in sorted(known) if not known[n].conflicts] + [n for n in requested if n != "all"]
    ordered: list[str] = []

    def add(name: str, why: str) -> None:
        if name in ordered:
            return
        reason = None if name in known else broken().get(name)
        if reason:
            raise PluginError(f"plugin {name!r} ({why}) is installed but broken: {reason}")
        if name not in known:
            raise PluginError(
                f"unknown plugin {name!r} ({why}). Known plugins: {', '.join(sorted(known)) or 'none'}. "
                "Fix: correct the name in SLIME_ASCEND_PLUGINS / ascend_plugins, or install the package "
                "that provides it."
            )
        for dep in known[name].requires:
            add(dep, f"required by {name!r}")
        ordered.append(name)

    for name in requested:
        add(name, "requested")

    plugins = tuple(known[n] for n in ordered)
    for plugin in plugins:
        for other in plugin.conflicts:
            if other in ordered:
                raise PluginError(
                    f"plugins {plugin.name!r} and {other!r} cannot be enabled together ({plugin.name!r} declares "
                    f"the conflict). Fix: enable only one of them."
                )

    slots: dict[str, list[tuple[str, Contribution]]] = {}
    for plugin in plugins:
        for contribution in plugin.contributions:
            slots.setdefault(contribution.slot, []).append((plugin.name, contribution))

    resolved: dict[str, tuple[tuple[str, Contribution], ...]] = {}
    for slot_name, entries in slots.items():
        slot = SLOTS[slot_name]
        if slot.mode == "exclusive" and len(entries) > 1:
            who = " and ".join(repr(p) for p, _ in entries)
            raise PluginError(
                f"hook slot {slot_name!r} (slime arg {slot.slime_arg or '-'}) takes one function, but plugins {who} "
                "both provide one. Fix: enable only one of them."
            )
        if slot.mode == "chain":
            seen: dict[int, str] = {}
            for plugin_name, contribution in entries:
                if contribution.order in seen:
                    raise PluginError(
                        f"plugins {seen[contribution.order]!r} and {plugin_name!r} both contribute to hook slot "
                        f"{slot_name!r} at order {contribution.order} and their order is not declared. "
                        "Fix: give one of the contributions a different order (see slime_ascend.plugins.slots)."
                    )
                seen[contribution.order] = plugin_name
        entries.sort(key=lambda item: (item[1].order, item[0]))
        resolved[slot_name] = tuple(entries)
    return Selection(plugins=plugins, slots=resolved)


"""Typed plugin settings: declared once, written into the YAML, validated against slime's args.

A setting is one of our own keys on slime's ``args`` (prefix ``ascend_``). slime loads the YAML
that ``slime-ascend config`` writes through its ``--custom-config-path`` flag and sets every key
on ``args``; values keep their raw YAML types, so every read goes through :func:`coerce`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

PREFIX = "ascend_"


class SettingsError(ValueError):
    """A setting has a wrong value. The message names the key, the value and the fix."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One typed key on slime's ``args``.

    ``type`` is one of ``bool``, ``int``, ``float``, ``str``, ``list`` (of scalars) or ``dict``
    (a YAML mapping or list of mappings, e.g. the OPD teachers section). ``check`` may reject a
    coerced value by returning a message that says what is allowed.
    """

    key: str
    type: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    check: Callable[[Any], str | None] | None = None
    optional: bool = False  # None is a legal value (means "not set")

    def __post_init__(self) -> None:
        if not self.key.startswith(PREFIX):
            raise ValueError(f"setting key {self.key!r} must start with {PREFIX!r}")
        if self.type not in (bool, int, float, str, list, dict):
            raise ValueError(f"setting {self.key!r}: unsupported type {self.type!r}")
        if self.default is not None or not self.optional:
            coerce(self, self.default)  # a bad default is a programming error: fail at import

    def describe_type(self) -> str:
        text = self.type.__name__
        if self.choices:
            text += " one of " + ", ".join(repr(c) for c in self.choices)
        if self.minimum is not None or self.maximum is not None:
            lo = "-inf" if self.minimum is None else repr(self.minimum)
            hi = "inf" if self.maximum is None else repr(self.maximum)
            text += f" in [{lo}, {hi}]"
        return text


def _fail(setting: Setting, value: Any, problem: str) -> SettingsError:
    return SettingsError(
        f"setting {setting.key}={value!r}: {problem}. Fix: set {setting.key} to a {setting.describe_type()} "
        f"in the YAML given to --custom-config-path (default {setting.default!r}; {setting.help})"
    )


def coerce(setting: Setting, value: Any) -> Any:
    """Return ``value`` converted to the setting's type, or raise :class:`SettingsError`."""
    if value is None:
        if setting.optional:
            return None
        raise _fail(setting, value, "a value is required")
    kind = setting.type
    if kind is bool:
        if isinstance(value, bool):
            out = value
        elif isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
            out = value.strip().lower() in ("true", "1", "yes")
        else:
            raise _fail(setting, value, "not a boolean")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)) or (
            isinstance(value, str) and not value.strip().lstrip("+-").isdigit()
        ):
            raise _fail(setting, value, "not an integer")
        out = int(value)
    elif kind is float:
        if isinstance(value, bool):
            raise _fail(setting, value, "not a number")
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise _fail(setting, value, "not a number") from None
        if out != out:
            raise _fail(setting, value, "NaN is not allowed")
        if out in (float("inf"), float("-inf")):  # e.g. an IcePop beta of .inf would keep every token
            raise _fail(setting, value, "an infinite value is not allowed (leave an optional setting unset instead)")
    elif kind is str:
        if not isinstance(value, str):
            raise _fail(setting, value, "not a string")
        out = value
    elif kind is list:
        if isinstance(value, str):
            out = [part.strip() for part in value.split(",") if part.strip()]
        elif isinstance(value, Sequence):
            out = list(value)
        else:
            raise _fail(setting, value, "not a list")
    else:  # dict: a mapping or a list of mappings
        if isinstance(value, Mapping):
            out = dict(value)
        elif isinstance(value, Sequence) and not isinstance(value, str) and all(
            isinstance(v, Mapping) for v in value
        ):
            out = [dict(v) for v in value]
        else:
            raise _fail(setting, value, "not a mapping (or a list of mappings)")
    if setting.choices is not None and out not in setting.choices:
        raise _fail(setting, value, "not an allowed choice")
    if setting.minimum is not None and out < setting.minimum:
        raise _fail(setting, value, f"below the minimum {setting.minimum!r}")
    if setting.maximum is not None and out > setting.maximum:
        raise _fail(setting, value, f"above the maximum {setting.maximum!r}")
    if setting.check is not None:
        problem = setting.check(out)
        if problem:
            raise _fail(setting, value, problem)
    return out


def read(setting: Setting, args: Any) -> Any:
    """Read one setting from ``args`` (missing means the declared default) and coerce it."""
    return coerce(setting, getattr(args, setting.key, setting.default))


class SettingsView(Mapping):
    """Read-only, validated settings of one plugin, by short name (``eps_low``) or full key."""

    def __init__(self, plugin_name: str, values: dict[str, Any]):
        self._plugin = plugin_name
        self._values = values

    def __getitem__(self, name: str) -> Any:
        if name.startswith(PREFIX):
            return self._values[name]
        matches = [k for k in self._values if k.endswith("_" + name) or k == PREFIX + name]
        if len(matches) != 1:
            raise KeyError(f"plugin {self._plugin!r} has no setting {name!r}; it has {sorted(self._values)}")
        return self._values[matches[0]]

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as exc:
            raise AttributeError(str(exc)) from None

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"SettingsView({self._plugin!r}, {self._values!r})"

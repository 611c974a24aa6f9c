"""Process-start activation, imported by ``slime_ascend_bootstrap.pth`` in every interpreter.

Inert unless ``SLIME_ASCEND_PLUGINS`` is set: then it loads the named plugins (entry-point group
``slime_ascend.plugins``), runs each plugin's process-start actions once, and arranges for the
plugins to be validated as soon as slime's ``args`` exist in this process
(:mod:`slime_ascend.plugins.early`). It never parses argv and never imports torch, ray, megatron or
slime itself; plugins register import hooks (:mod:`slime_ascend._import_hooks`) for work that must
happen when those are imported.

A failure here must not break an unrelated interpreter (the ``.pth`` runs this in every interpreter
of the environment, pip included), so whatever plugin code raises, ``SystemExit`` and
``KeyboardInterrupt`` included, is printed once to stderr and kept: :func:`activation_error`
returns it, and the first validation point or hook dispatcher call raises it.
"""

from __future__ import annotations

import os
import sys
import threading

ENV = "SLIME_ASCEND_PLUGINS"

_lock = threading.Lock()
_started: set[str] = set()
_error: BaseException | None = None


def activate(value: str | None = None) -> list[str]:
    """Run the process-start actions of the plugins named in ``value`` (default: the environment).

    Idempotent and thread-safe: an action runs at most once per process. Returns the names of
    the plugins whose actions ran in this call.
    """
    global _error
    value = os.environ.get(ENV, "") if value is None else value
    if not value.strip():
        return []
    from .plugins import registry
    from .plugins.base import resolve

    ran: list[str] = []
    with _lock:
        try:
            selection = registry.resolve_selection(registry.parse_names(value))
            for plugin in selection.plugins:
                if plugin.name in _started:
                    continue
                for path in plugin.process_start:
                    resolve(path)()
                _started.add(plugin.name)
                ran.append(plugin.name)
            from .plugins import early, patch_plan

            patch_plan.install_at_process_start([p for p in selection.plugins if p.name in ran])

            early.install()
        except BaseException as exc:  # noqa: BLE001 - plugin code must not end the interpreter; kept, re-raised at use
            _error = exc
            what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            print(f"slime-ascend: activation of {ENV}={value!r} failed: {what}", file=sys.stderr)
    return ran


def started() -> frozenset[str]:
    return frozenset(_started)


def activation_error() -> BaseException | None:
    return _error


def raise_activation_error(where: str = "") -> None:
    """Raise the kept process-start failure as a PluginError (the first validation point or hook call does)."""
    if _error is not None:
        from .plugins.registry import PluginError

        raise PluginError(f"slime-ascend failed to activate at process start{where} "
                          f"({type(_error).__name__}: {_error})") from _error


if os.environ.get(ENV):
    activate()

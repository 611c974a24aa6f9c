"""Process-start activation, imported by ``slime_ascend_bootstrap.pth`` in every interpreter.

Inert unless ``SLIME_ASCEND_PLUGINS`` is set: then it arms the emulated Ascend device when
``SLIME_ASCEND_EMULATE_NPU=1`` asks for it (:func:`slime_ascend.npu_emulation.arm_from_environment`, before any
plugin runs), loads the named plugins (entry-point group ``slime_ascend.plugins``), runs each plugin's process-start
actions once, registers their import-moment
runtime patches (:mod:`.patch_plan`) and the runtime's own role-entry patches, which validate the plugins as
soon as slime's ``args`` exist in this process (:mod:`.early`). It never parses argv and never imports
torch, ray, megatron or slime itself; plugins register import hooks (:mod:`slime_ascend._import_hooks`) for
work that must happen when those are imported.

A failure here must not break an unrelated interpreter (the ``.pth`` runs this in every interpreter
of the environment, pip included), so whatever plugin code raises, ``SystemExit`` and
``KeyboardInterrupt`` included, is printed once to stderr and kept
(:func:`slime_ascend.plugins.runtime.keep_activation_error`): :func:`activation_error` returns it, and the
first validation point or hook dispatcher call raises it.
"""

from __future__ import annotations

import os
import sys
import threading

from ..plugins.runtime import ENV, activation_error, keep_activation_error, raise_activation_error

__all__ = ["ENV", "activate", "activation_error", "raise_activation_error", "started"]

_lock = threading.Lock()
_started: set[str] = set()


def activate(value: str | None = None) -> list[str]:
    """Run the process-start actions of the plugins named in ``value`` (default: the environment).

    Idempotent and thread-safe: an action runs at most once per process. Returns the names of
    the plugins whose actions ran in this call.
    """
    value = os.environ.get(ENV, "") if value is None else value
    if not value.strip():
        return []
    from ..plugins import registry
    from ..plugins.base import resolve

    ran: list[str] = []
    with _lock:
        try:
            from ..npu_emulation import arm_from_environment

            arm_from_environment()  # SLIME_ASCEND_EMULATE_NPU: torch_npu findable before any plugin looks for it
            selection = registry.resolve_selection(registry.parse_names(value))
            for plugin in selection.plugins:
                if plugin.name in _started:
                    continue
                for path in plugin.process_start:
                    resolve(path)()
                _started.add(plugin.name)
                ran.append(plugin.name)
            from . import early, patch_plan

            patch_plan.install_at_process_start([p for p in selection.plugins if p.name in ran])

            early.install()
        except BaseException as exc:  # noqa: BLE001 - plugin code must not end the interpreter; kept, re-raised at use
            keep_activation_error(exc)
            what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            print(f"slime-ascend: activation of {ENV}={value!r} failed: {what}", file=sys.stderr)
    return ran


def started() -> frozenset[str]:
    return frozenset(_started)


if os.environ.get(ENV):
    activate()

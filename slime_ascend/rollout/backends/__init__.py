"""Rollout backends: what slime needs to start and talk to an NPU rollout engine.

A :class:`RolloutBackend` turns a plugin's settings (``ascend_rollout_*`` keys, by short name)
into four things, each a plain value a test or ``doctor`` can inspect:

* ``server_args(options)``: SGLang ``ServerArgs`` fields for engines slime launches itself;
* ``env(options)``: environment the engine process needs (export it before ``ray start``;
  the engine-side bridge also fills it in, see :mod:`slime_ascend.patch.engine`);
* ``slime_flags(options, addrs)``: what to add to slime's command line;
* ``validate(options)``: problems (empty when the options are usable).

Each backend module has one ``BACKEND`` object: :mod:`.sglang_npu`, :mod:`.vllm_ascend`, :mod:`.torch_engine`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["RolloutBackend", "BackendError"]


class BackendError(ValueError):
    """A backend cannot be used as configured; the message names the option and the fix."""


class RolloutBackend:
    """Base class. Subclasses set ``name``/``description``/``plugin`` and override the producers.

    ``options`` are the plugin's settings by short name (``attention_backend`` for
    ``ascend_rollout_attention_backend``); :meth:`defaults` gives the declared defaults.
    """

    name: str = ""
    description: str = ""
    plugin: str | None = None  # the slime-ascend plugin whose settings feed this backend

    def settings(self) -> tuple:
        from ..plugin import SGLANG_NPU, TORCH_ENGINE, VLLM_ASCEND

        return {p.name: p.settings for p in (SGLANG_NPU, VLLM_ASCEND, TORCH_ENGINE)}.get(self.plugin, ())

    def defaults(self) -> dict[str, Any]:
        return {_short(s.key): s.default for s in self.settings()}

    def options(self, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Declared defaults updated with ``overrides`` (short names or full keys), each coerced."""
        from ...plugins.settings import coerce

        by_short = {_short(s.key): s for s in self.settings()}
        values = self.defaults()
        for key, value in (overrides or {}).items():
            short = _short(key)
            if short not in by_short:
                raise BackendError(
                    f"backend {self.name!r} has no option {key!r}; it has {sorted(by_short) or 'none'}"
                )
            values[short] = coerce(by_short[short], value)
        return values

    def options_from_args(self, args: Any) -> dict[str, Any]:
        """Options read from slime's ``args`` (keys set by the YAML), defaults where absent."""
        from ...plugins.settings import read

        return {_short(s.key): read(s, args) for s in self.settings()}

    # -- producers (override) ---------------------------------------------------------------
    def server_args(self, options: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def env(self, options: Mapping[str, Any]) -> dict[str, str]:
        return {}

    def slime_flags(self, options: Mapping[str, Any], addrs: list[str] | None = None) -> list[str]:
        return []

    def validate(self, options: Mapping[str, Any]) -> list[str]:
        return []

    def check(self, options: Mapping[str, Any]) -> None:
        problems = self.validate(options)
        if problems:
            raise BackendError(f"rollout backend {self.name!r}: " + "; ".join(problems))


def _short(key: str) -> str:
    for prefix in ("ascend_rollout_", "ascend_"):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key

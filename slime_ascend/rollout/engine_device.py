"""The device names an engine of this package computes on (``serve-torch --device``, the torch-engine plugin's
``ascend_rollout_torch_device``): ``cpu``, ``cuda[:N]``, ``npu[:N]``. Names only (checked at argument parsing and
at ``parse_args``, before torch loads); :mod:`slime_ascend.rollout.torch_engine.device` resolves them."""

from __future__ import annotations

import re

__all__ = ["check_name", "parse_name"]

_NAME = re.compile(r"^(cpu|cuda|npu)(?::(\d+))?$")


def check_name(name: str) -> str:
    """``name`` when it reads as a device the engine knows (``cpu``, ``cuda[:N]``, ``npu[:N]``); ValueError naming
    the accepted forms otherwise. Imports nothing."""
    if not isinstance(name, str) or not _NAME.match(name.strip()):
        raise ValueError(f"device {name!r}: use cpu, cuda, cuda:N, npu or npu:N")
    return name.strip()


def parse_name(name: str) -> tuple[str, int | None]:
    """``(device type, index or None)`` of a name :func:`check_name` accepts."""
    kind, index = _NAME.match(check_name(name)).groups()
    return kind, None if index is None else int(index)

"""``typing.override`` on Python 3.11.

megatron-core 0.17+ (``megatron.training.models``) imports ``override`` from ``typing``, which exists
from Python 3.12 on; slime's tested path imports it at argument parsing. On 3.11 the name is
added, as ``typing_extensions.override`` (the same identity decorator, which only sets
``__override__``). It never replaces an existing name.
"""

from __future__ import annotations

import typing


def ensure() -> bool:
    """Add ``typing.override`` when it is missing; True when it had to be added."""
    if hasattr(typing, "override"):
        return False
    try:
        from typing_extensions import override
    except ImportError:  # pragma: no cover - typing_extensions ships with torch

        def override(method):
            try:
                method.__override__ = True
            except (AttributeError, TypeError):
                pass
            return method

    typing.override = override
    return True

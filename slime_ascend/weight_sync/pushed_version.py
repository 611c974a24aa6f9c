"""The version every rollout engine serves after a push over a collective (``update_weights_from_distributed``,
``--colocate``'s ``update_weights_from_tensor``), read back, not assumed.

On those transports the train actors push the buckets themselves and each engine switches when its last
bucket arrived and was checked (the torch engine: :mod:`slime_ascend.rollout.torch_engine.weight_group`); the
driver learns nothing. After slime's ``RayTrainGroup.update_weights`` returns, :func:`acknowledge_push` reads
every engine's ``/get_weight_version`` back: every engine must serve one and the same numeric version, newer
than the last acknowledged one, or :class:`~slime_ascend.weight_sync.acknowledged.WeightUpdateError` names each
engine and what it serves (a broadcast that broke off leaves an engine on its old version). The runtime patch
``driver.acknowledged_collective_update`` publishes the result (:mod:`.served_version`) for ``staleness``, as
the disk switch does. No slime or Ray import here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from .acknowledged import WeightUpdateError

logger = logging.getLogger(__name__)

__all__ = ["acknowledge_push"]


def acknowledge_push(engines: Sequence[Any], get: Callable, previous: int | None,
                     deadline_s: float | None = None) -> int:
    """The version every engine serves after a push (module docstring); ``get`` is ``ray.get`` (each answer
    waited for at most ``deadline_s``; None: for ever)."""
    served: dict[int, str] = {}
    for i, engine in enumerate(engines):
        ref = engine.get_weight_version.remote()
        try:
            served[i] = str(get(ref) if deadline_s is None else get(ref, timeout=deadline_s))
        except Exception as exc:  # noqa: BLE001 - named with the others
            served[i] = f"no version read back ({' '.join(str(exc).split())[:200] or type(exc).__name__})"
    versions = set(served.values())
    version = versions.pop() if len(versions) == 1 else None
    what = "; ".join(f"engine {i}: {v}" for i, v in sorted(served.items()))
    if version is None or not version.isdigit():
        raise WeightUpdateError(f"after the weight push the rollout engines do not serve one numeric version ({what}); "
                                "a broadcast that broke off leaves an engine on its old version. Fix: look at that "
                                "engine's log, restart it, and push again")
    if previous is not None and int(version) <= previous:
        raise WeightUpdateError(f"after the weight push every rollout engine still serves version {version} (the last "
                                f"acknowledged was {previous}): the push did not switch them. Fix: look at the engines' "
                                "logs")
    logger.info("weight version %s acknowledged by every engine (%d) after the push", version, len(engines))
    return int(version)

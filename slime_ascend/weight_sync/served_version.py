"""The weight version every rollout engine acknowledged last, shared between slime's processes.

The driver (where slime's ``RayTrainGroup`` switches the engines) publishes it after each
acknowledged switch (:mod:`slime_ascend.weight_sync.acknowledged`); the RolloutManager (where the
``staleness`` plugin judges samples) reads it. It lives in a small named Ray actor of the job
(``num_cpus=0``), created on the first publish and gone with the job.
"""

from __future__ import annotations

import threading
from typing import Any

NAME = "slime_ascend_served_weight_version"
_lock = threading.Lock()
_handle: Any = None


def _actor_class():
    import ray

    @ray.remote(num_cpus=0)
    class ServedWeightVersion:
        def __init__(self) -> None:
            self.version: int | None = None

        def set(self, version: int) -> None:
            self.version = version

        def get(self) -> int | None:
            return self.version

    return ServedWeightVersion


def publish(version: int | str) -> None:
    """Record ``version`` as the one every engine serves (driver side)."""
    import ray

    global _handle
    with _lock:
        if _handle is None:
            _handle = _actor_class().options(name=NAME, get_if_exists=True).remote()
        ray.get(_handle.set.remote(int(version)))


def acknowledged() -> int | None:
    """The last published version, or None when none was published in this job (no acknowledged
    switch: another transport, or the patch is not active)."""
    import ray

    global _handle
    with _lock:
        if _handle is None:
            try:
                _handle = ray.get_actor(NAME)
            except ValueError:
                return None
        return ray.get(_handle.get.remote())


def reset() -> None:
    """Forget the cached handle (tests)."""
    global _handle
    with _lock:
        _handle = None

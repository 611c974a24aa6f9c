"""A :class:`~slime_ascend.opd.pool.TeacherPool` behind a Ray actor: built from serialisable arguments,
answering with plain data, so that rollout workers can share one pool."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from slime_ascend.opd.loaders import TeacherLoader
from slime_ascend.opd.pool import TeacherPool

__all__ = ["TeacherPoolService", "make_teacher_pool_actor"]


class TeacherPoolService:
    """A :class:`TeacherPool` built from serialisable arguments, with plain-data results.

    ``loader_factory`` is called inside the owning process (e.g. a Ray actor) to build the
    loader, so unpicklable things (models, sessions) never cross process boundaries.
    """

    def __init__(
        self,
        teachers: Sequence[Mapping[str, Any]],
        loader_factory: Callable[[], TeacherLoader],
        **pool_kwargs: Any,
    ) -> None:
        self.pool = TeacherPool(teachers, loader_factory(), **pool_kwargs)

    def activate(self, name: str) -> dict[str, Any]:
        return asdict(self.pool.activate(name))

    def prefetch(self, name: str) -> bool:
        return self.pool.prefetch(name)

    def set_schedule(self, names: Sequence[str]) -> None:
        self.pool.set_schedule(names)

    def active(self) -> str | None:
        return self.pool.active

    def state(self) -> dict[str, dict[str, Any]]:
        return self.pool.state()

    def metrics(self) -> dict[str, float]:
        return self.pool.metrics()

    def close(self) -> None:
        self.pool.close()


def make_teacher_pool_actor(**ray_options: Any) -> Any:
    """``ray.remote(**ray_options)(TeacherPoolService)``, an actor class rollout workers can share.

    Ray is imported lazily; raises ImportError with a hint when it is not installed. Ray actors run
    one call at a time by default, so ``activate`` calls from several workers are serialised.
    """
    try:
        import ray
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("make_teacher_pool_actor needs ray; install ray or use TeacherPool directly") from e
    return ray.remote(**ray_options)(TeacherPoolService) if ray_options else ray.remote(TeacherPoolService)

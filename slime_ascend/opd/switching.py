"""Switching a teacher engine between teachers without stalling the resident one.

A :class:`SwitchGate` lets requests of the resident teacher run concurrently and switches only when
none is in flight, serving waiters first-come first-served by teacher, so one switch serves every
queued request of that teacher. :class:`_PoolSwitcher` drives the
:class:`~slime_ascend.opd.pool.TeacherPool` (in-process, or the named Ray actor ``ascend_opd_pool_actor``)
that loads a teacher with ``/update_weights_from_disk``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from .teachers import TeacherSpec

class SwitchGate:
    """Serialise access to one engine that holds one teacher at a time.

    Requests for the resident teacher run concurrently. A request for another teacher waits until
    nothing is in flight; then the teacher of the *oldest* waiting request is switched in and every
    request queued for it at that moment enters. A request for the resident teacher that arrives
    after a request for another teacher queues behind it (first come, first served by teacher: no
    starvation; each switch serves a whole batch).

    Args:
        switch: ``async fn(name)`` that makes ``name`` resident (raises on failure).
        prefetch: optional ``async fn(name)`` called after a switch with the next teacher waited for.
    """

    def __init__(
        self,
        switch: Callable[[str], Awaitable[Any]],
        prefetch: Callable[[str], Awaitable[Any]] | None = None,
    ) -> None:
        self._switch = switch
        self._prefetch = prefetch
        self.active: str | None = None
        self.inflight = 0
        self.switches = 0
        self.wait_s = 0.0
        self._queue: OrderedDict[int, str] = OrderedDict()
        self._tickets = itertools.count()
        self._batch_end = -1
        self._cond = asyncio.Condition()

    def _oldest_other(self, name: str) -> int | None:
        for ticket, other in self._queue.items():
            if other != name:
                return ticket
        return None

    @contextlib.asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[None]:
        t0 = time.perf_counter()
        async with self._cond:
            ticket = next(self._tickets)
            self._queue[ticket] = name
            try:
                while True:
                    if self.active == name:
                        other = self._oldest_other(name)
                        if ticket <= self._batch_end or other is None or other > ticket:
                            break
                    elif self.inflight == 0 and next(iter(self._queue.values())) == name:
                        await self._switch(name)  # holding the lock: nobody enters during a switch
                        self.active = name
                        self.switches += 1
                        self._batch_end = next(reversed(self._queue))  # everyone queued for it now enters
                        self._cond.notify_all()
                        nxt = self._oldest_other(name)
                        if nxt is not None and self._prefetch is not None:
                            await self._prefetch(self._queue[nxt])
                        continue
                    await self._cond.wait()
            finally:
                del self._queue[ticket]
                self._cond.notify_all()  # a failed switch must not leave the others waiting
            self.inflight += 1
            self.wait_s += time.perf_counter() - t0
        try:
            yield
        finally:
            async with self._cond:
                self.inflight -= 1
                self._cond.notify_all()

class _PoolSwitcher:
    """Switch the engines of ``ascend_opd_switch_engine_urls`` through a TeacherPool (local or Ray actor)."""

    def __init__(self, teachers: Sequence[TeacherSpec], settings: Mapping[str, Any], student: Mapping[str, Any]):
        from .engine_loader import SGLangEngineLoader

        urls = list(settings["ascend_opd_switch_engine_urls"])
        factory = functools.partial(SGLangEngineLoader, urls, stage_dir=settings["ascend_opd_stage_dir"])
        specs = [t.to_dict() for t in teachers]
        self.prefetch_enabled = bool(settings["ascend_opd_prefetch"])
        self.actor_name = settings["ascend_opd_pool_actor"]
        self._local = None
        self._actor = None
        self._ray = None
        if self.actor_name:
            import ray

            from .pool_actor import make_teacher_pool_actor

            self._actor = make_teacher_pool_actor().options(
                name=self.actor_name, get_if_exists=True, max_concurrency=1
            ).remote(specs, factory, **student)
            self._ray = ray
        else:
            from .pool import TeacherPool

            self._local = TeacherPool(specs, factory(), **student)
        if self.prefetch_enabled:
            # stage the first switched teacher while the first rollout generates, so that the first
            # switch is a prefetch hit rather than a cold copy in the scoring path
            self.set_schedule([t.name for t in teachers])

    def set_schedule(self, names: Sequence[str]) -> None:
        if self._actor is not None:
            self._actor.set_schedule.remote(list(names))  # fire and forget; the actor runs it in order
        else:
            self._local.set_schedule(list(names))

    async def activate(self, name: str) -> None:
        if self._actor is not None:
            await self._actor.activate.remote(name)
        else:
            await asyncio.to_thread(self._local.activate, name)

    async def prefetch(self, name: str) -> None:
        if not self.prefetch_enabled:
            return
        if self._actor is not None:
            self._actor.prefetch.remote(name)  # fire and forget; the actor runs it in order
        else:
            self._local.prefetch(name)

    def metrics(self) -> dict[str, Any]:
        if self._actor is not None:
            return dict(self._ray.get(self._actor.metrics.remote()))
        return self._local.metrics()

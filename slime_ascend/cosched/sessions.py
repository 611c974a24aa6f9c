"""``cosched``'s placement of compaction's episodes (set as ``compaction.generate``'s episode router by the plugin's
process-start action, :func:`process_start`).

An episode is one session (slime's ``Sample.session_id``): each of its turns (compaction's actions and summaries,
one ``/generate`` each) takes a slot of the dispatcher on the engine that served its last turn while that engine has
one (its prefix is cached there), else it is moved, counted; the slot is held only while the engine answers (not
while the environment steps). Each answer's ``cached_tokens`` (the engine's own prefix-cache report) and, where the
engine reports it, the weight version of the reused prefix (the torch engine's ``cached_weight_version``) are
recorded per engine (:meth:`CapacityDispatcher.record_answer`).
"""

from __future__ import annotations

import dataclasses
import functools
import uuid
from typing import Any

from . import hooks


def stale_prefix(meta: dict) -> bool | None:
    """Whether an answer reused a prefix of another weight version than the one that answered; False when it
    reused nothing, None when it reused some and the engine did not say of which version (SGLang keeps no tag)."""
    if not int(meta.get("cached_tokens") or 0):
        return False
    prefix = meta.get("cached_weight_version")
    if prefix is None:
        return None
    return str(prefix) != str(meta.get("weight_version"))


@functools.cache
def _client(url: str):
    from ..rollout.engine_client import EngineClient

    return EngineClient(url.rstrip("/") + "/generate")


@dataclasses.dataclass(frozen=True)
class SessionEngine:
    """compaction's engine (``await generate(input_ids, sampling_params) -> GenerationResult``) through the
    dispatcher: every call is a turn of ``session``, sent to the engine the dispatcher picks (the session's owner
    while it has a free slot), the slot held only while the engine answers."""

    args: Any
    session: str

    async def generate(self, input_ids, sampling_params: dict[str, Any]):
        d = hooks.dispatcher(self.args)
        await hooks._refresh(self.args, d)
        owner = d.owner(self.session)
        cost = hooks.request_cost(self.args, d, len(input_ids), sampling_params)
        url = await d.acquire(self.session, cost)
        try:
            result = await _client(url).generate(input_ids, sampling_params)
        finally:
            d.release(url, cost)
        meta = result.meta_info or {}
        d.record_answer(url, int(meta.get("prompt_tokens", len(input_ids)) or 0), int(meta.get("cached_tokens") or 0),
                        owner_turn=owner is not None and owner == url, stale_prefix=stale_prefix(meta))
        return result


def _to_router(args: Any, engine: Any) -> bool:
    """compaction's own client to slime's router (not a test's engine, not another transport)."""
    from ..rollout.engine_client import EngineClient, generate_url_from_args

    try:
        return isinstance(engine, EngineClient) and engine.url == generate_url_from_args(args)
    except ValueError:
        return False


async def route_episode(run, args: Any, sample: Any, sampling_params: dict, *, settings: Any, runtime: Any):
    """compaction's episode router: an episode that would talk to slime's router runs through ``run`` with a
    :class:`SessionEngine` of its own session in ``runtime``; any other runtime (a test's engine) is left alone."""
    if not _to_router(args, runtime.engine):
        return await run(args, sample, sampling_params, settings=settings, runtime=runtime)
    session = getattr(sample, "session_id", None) or f"cosched-{uuid.uuid4()}"
    routed = dataclasses.replace(runtime, engine=SessionEngine(args, session))
    try:
        return await run(args, sample, sampling_params, settings=settings, runtime=routed)
    finally:
        if hooks._dispatcher is not None:
            hooks._dispatcher.end_session(session)


def _route_compaction(module: Any) -> None:
    """``slime_ascend.compaction.generate`` was imported: its episodes go through :func:`route_episode`."""
    module.set_episode_router(route_episode)
    hooks.logger.info("cosched: compaction's turns are dispatched, one session per episode")


def process_start() -> None:
    """The plugin's process-start action: compaction's episodes are dispatched when compaction is imported (the
    RolloutManager's process; nothing happens where it is never imported)."""
    from .. import _import_hooks

    _import_hooks.when_imported("slime_ascend.compaction.generate", _route_compaction)

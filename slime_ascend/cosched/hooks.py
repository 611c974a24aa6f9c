"""The ``cosched`` adapter in slime's rollout process: each ``generate`` call holds a slot of the dispatcher while it
runs, and is sent straight to that engine (slime's own ``generate`` with the engine's address in place of the
router's); the engines are the router's workers (``GET /workers``, as slime's ``abort`` reads them).

Installed by the ``rollout.cosched_generate`` patch; the per-rollout counts go out through the reward post-process
chain (:func:`report`), as ``rollout/cosched_*`` keys of slime's rollout metrics.

**Compaction** (multi-turn): ``compaction``'s generate calls the engines itself, one ``/generate`` per turn (its
actions and summaries), so slime's ``generate`` is never reached. With both plugins on, every turn of an episode is
dispatched instead (:class:`SessionEngine`, put in place of the router client by :func:`route_compaction`, which the
plugin's process-start action hooks onto ``slime_ascend.compaction.generate`` when it is imported): the episode is
one session (slime's ``Sample.session_id``), each turn takes a slot on the engine that served its last turn while
that engine has one (its prefix is cached there), else it is moved, counted; the slot is released between turns
(while the environment steps). Each answer's ``cached_tokens`` (the engine's own prefix-cache report) and, where
the engine reports it, the weight version of the reused prefix (the torch engine's ``cached_weight_version``) are
recorded per engine (:meth:`CapacityDispatcher.record_answer`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

from .dispatch import CapacityDispatcher

logger = logging.getLogger(__name__)

_dispatcher: CapacityDispatcher | None = None
_listed_at = -1.0


def _settings(args: Any):
    from ..plugins import runtime

    return runtime.settings(args, "cosched")


def dispatcher(args: Any) -> CapacityDispatcher:
    global _dispatcher
    if _dispatcher is None:
        capacity = _settings(args).capacity or int(getattr(args, "sglang_server_concurrency", 0) or 1)
        _dispatcher = CapacityDispatcher(capacity)
    return _dispatcher


async def _refresh(args: Any, d: CapacityDispatcher) -> None:
    global _listed_at
    now = time.monotonic()
    if d.engines and now - _listed_at < _settings(args).refresh_s:
        return
    from slime.utils.http_utils import get

    listed = await get(f"http://{args.sglang_router_ip}:{args.sglang_router_port}/workers")
    urls = [w["url"] for w in (listed or {}).get("workers", []) if isinstance(w, dict) and w.get("url")]
    if not urls:
        raise RuntimeError(f"cosched: the router at {args.sglang_router_ip}:{args.sglang_router_port} lists no "
                           "worker; no engine to send the request to")
    if urls != d.engines:
        logger.info("cosched: dispatching over %d engines, %d slots each: %s", len(urls), d.capacity, urls)
    d.set_engines(urls)
    _listed_at = now


def _routed(args: Any, url: str) -> Any:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    routed = copy.copy(args)  # slime's generate builds its URL from these two fields only
    routed.sglang_router_ip, routed.sglang_router_port = parts.hostname, parts.port
    return routed


async def generate(original, args: Any, sample: Any, sampling_params: dict) -> Any:
    d = dispatcher(args)
    await _refresh(args, d)
    url = await d.acquire(getattr(sample, "session_id", None))
    try:
        return await original(_routed(args, url), sample, sampling_params)
    finally:
        d.release(url)


def _stale_prefix(meta: dict) -> bool | None:
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


class SessionEngine:
    """compaction's engine (``await generate(input_ids, sampling_params) -> GenerationResult``) through the
    dispatcher: every call is a turn of ``session``, sent to the engine the dispatcher picks (the session's owner
    while it has a free slot), the slot held only while the engine answers."""

    def __init__(self, args: Any, session: str) -> None:
        self.args = args
        self.session = session

    async def generate(self, input_ids, sampling_params: dict[str, Any]):
        d = dispatcher(self.args)
        await _refresh(self.args, d)
        owner = d.owner(self.session)
        url = await d.acquire(self.session)
        try:
            result = await _client(url).generate(input_ids, sampling_params)
        finally:
            d.release(url)
        meta = result.meta_info or {}
        d.record_answer(url, int(meta.get("prompt_tokens", len(input_ids)) or 0), int(meta.get("cached_tokens") or 0),
                        owner_turn=owner is not None and owner == url, stale_prefix=_stale_prefix(meta))
        return result


def _to_router(args: Any, engine: Any) -> bool:
    """compaction's own client to slime's router (not a test's engine, not another transport)."""
    from ..rollout.engine_client import EngineClient, generate_url_from_args

    try:
        return isinstance(engine, EngineClient) and engine.url == generate_url_from_args(args)
    except ValueError:
        return False


def route_compaction(module: Any) -> None:
    """Wrap ``module.run_compaction_rollout`` (``slime_ascend.compaction.generate``, which its ``generate`` calls
    through the module's globals) so that an episode that would talk to slime's router talks to the dispatcher,
    as one session. Idempotent."""
    original = module.run_compaction_rollout
    if getattr(original, "_cosched", False):
        return

    @functools.wraps(original)
    async def run_compaction_rollout(args, sample, sampling_params, *, settings, runtime):
        if not _to_router(args, runtime.engine):
            return await original(args, sample, sampling_params, settings=settings, runtime=runtime)
        session = getattr(sample, "session_id", None) or f"cosched-{uuid.uuid4()}"
        routed = dataclasses.replace(runtime, engine=SessionEngine(args, session))
        try:
            return await original(args, sample, sampling_params, settings=settings, runtime=routed)
        finally:
            if _dispatcher is not None:
                _dispatcher.end_session(session)

    run_compaction_rollout._cosched = True
    module.run_compaction_rollout = run_compaction_rollout
    logger.info("cosched: compaction's turns are dispatched, one session per episode")


def process_start() -> None:
    """The plugin's process-start action: compaction's episodes are dispatched when compaction is imported (the
    RolloutManager's process; nothing happens where it is never imported)."""
    from .. import _import_hooks

    _import_hooks.when_imported("slime_ascend.compaction.generate", route_compaction)


def report(args: Any, samples: list, raw_rewards: list, rewards: list) -> tuple[list, list]:
    """reward_post_process chain contribution: this rollout's dispatch counts in slime's rollout metrics."""
    if _dispatcher is not None:
        from ..plugins.rollout_metrics import report as publish

        publish(args, logger, "cosched", _dispatcher.take_stats())
    return raw_rewards, rewards


def reset() -> None:
    """Forget the dispatcher (tests)."""
    global _dispatcher, _listed_at
    _dispatcher, _listed_at = None, -1.0

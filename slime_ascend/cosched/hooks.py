"""The ``cosched`` adapter in slime's rollout process: each ``generate`` call holds a slot of the dispatcher while it
runs, and is sent straight to that engine (slime's own ``generate`` with the engine's address in place of the
router's); the engines are the router's workers (``GET /workers``, as slime's ``abort`` reads them).

Installed by the ``rollout.cosched_generate`` patch; the per-rollout counts go out through the reward post-process
chain (:func:`report`), as ``rollout/cosched_*`` keys of slime's rollout metrics.

**Compaction** (multi-turn): ``compaction``'s generate calls the engines itself, one ``/generate`` per turn (its
actions and summaries), so slime's ``generate`` is never reached. With both plugins on, every turn of an episode is
dispatched instead (:mod:`slime_ascend.cosched.sessions`, whose process-start action sets it as compaction's episode
router, ``compaction.generate.set_episode_router``, when that module is imported): the episode is
one session (slime's ``Sample.session_id``), each turn takes a slot on the engine that served its last turn while
that engine has one (its prefix is cached there), else it is moved, counted; the slot is released between turns
(while the environment steps). Each answer's ``cached_tokens`` (the engine's own prefix-cache report) and, where
the engine reports it, the weight version of the reused prefix (the torch engine's ``cached_weight_version``) are
recorded per engine (:meth:`CapacityDispatcher.record_answer`).
"""

from __future__ import annotations

import copy
import logging
import time
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

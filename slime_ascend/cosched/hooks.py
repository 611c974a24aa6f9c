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
        settings = _settings(args)
        capacity = settings.capacity or int(getattr(args, "sglang_server_concurrency", 0) or 1)
        _dispatcher = CapacityDispatcher(capacity, unit=settings.unit)
    return _dispatcher


_PD_MODES = ("prefill", "decode")


def _refuse_disaggregated(where: str, mode: Any) -> None:
    if mode in _PD_MODES:
        raise RuntimeError(f"cosched: {where} is a {mode} server of a prefill/decode-disaggregated deployment; cosched "
                           "places whole requests on one engine and cannot pair prefill with decode. Fix: drop "
                           "cosched from SLIME_ASCEND_PLUGINS for this job (slime's router pairs them)")


async def _kv_budgets(urls: list[str], fraction: float) -> dict[str, int]:
    """Each engine's KV budget: ``fraction`` of the ``max_total_num_tokens`` its ``/v1/loads`` reports, summed over
    its data-parallel ranks (SGLang's answer; the torch engine's with ``--max-total-tokens``)."""
    from slime.utils.http_utils import get

    budgets = {}
    for url in urls:
        answer = await get(url.rstrip("/") + "/v1/loads")
        ranks = answer.get("loads") if isinstance(answer, dict) else None
        ranks = [r for r in ranks if isinstance(r, dict)] if isinstance(ranks, list) else []
        for rank in ranks:
            _refuse_disaggregated(url, (rank.get("disaggregation") or {}).get("mode"))
        total = sum(int(r.get("max_total_num_tokens") or 0) for r in ranks)
        if total <= 0:
            raise RuntimeError(f"cosched: ascend_cosched_unit is kv_tokens but {url}/v1/loads reports no "
                               "max_total_num_tokens (the engine's KV capacity). Fix: an SGLang that serves /v1/loads, "
                               "serve-torch with --max-total-tokens N, or ascend_cosched_unit: requests")
        budgets[url] = max(1, int(total * fraction))
    return budgets


async def _refresh(args: Any, d: CapacityDispatcher) -> None:
    global _listed_at
    now = time.monotonic()
    settings = _settings(args)
    if d.engines and now - _listed_at < settings.refresh_s:
        return
    from slime.utils.http_utils import get

    listed = await get(f"http://{args.sglang_router_ip}:{args.sglang_router_port}/workers")
    workers = [w for w in (listed or {}).get("workers", []) if isinstance(w, dict) and w.get("url")]
    for worker in workers:  # sglang-router names each worker's role (slime's sglang_config: regular/prefill/decode)
        _refuse_disaggregated(worker["url"], worker.get("worker_type"))
    urls = [w["url"] for w in workers]
    if not urls:
        raise RuntimeError(f"cosched: the router at {args.sglang_router_ip}:{args.sglang_router_port} lists no "
                           "worker; no engine to send the request to")
    budgets = (await _kv_budgets(urls, float(settings.kv_fraction))
               if d.unit == "kv_tokens" else None)
    if urls != d.engines:
        logger.info("cosched: dispatching over %d engines, %s: %s", len(urls),
                    f"{d.capacity} slots each" if budgets is None else f"KV tokens {budgets}", urls)
    d.set_engines(urls, budgets)
    _listed_at = now


def request_cost(args: Any, d: CapacityDispatcher, prompt_tokens: int, sampling_params: dict) -> int:
    """What a request takes of its engine's budget: one slot, or in KV tokens its prompt plus the tokens it may
    generate (``max_new_tokens``, else slime's ``--rollout-max-response-len``)."""
    if d.unit != "kv_tokens":
        return 1
    new = (sampling_params or {}).get("max_new_tokens") or getattr(args, "rollout_max_response_len", 0) or 0
    return max(1, int(prompt_tokens) + int(new))


def _prompt_tokens(args: Any, sample: Any) -> int:
    """The tokens of the prompt slime's generate will send: the sample's own tokens when it has them (a later
    turn), else its prompt through slime's tokenizer."""
    tokens = getattr(sample, "tokens", None)
    if tokens:
        return len(tokens)
    prompt = getattr(sample, "prompt", "")
    if not isinstance(prompt, str):
        return sum(len(str(m.get("content", ""))) for m in prompt if isinstance(m, dict))  # characters: an upper bound
    from slime.rollout.sglang_rollout import GenerateState

    return len(GenerateState(args).tokenizer(prompt, add_special_tokens=False)["input_ids"])


def _routed(args: Any, url: str) -> Any:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    routed = copy.copy(args)  # slime's generate builds its URL from these two fields only
    routed.sglang_router_ip, routed.sglang_router_port = parts.hostname, parts.port
    return routed


async def generate(original, args: Any, sample: Any, sampling_params: dict) -> Any:
    d = dispatcher(args)
    await _refresh(args, d)
    cost = request_cost(args, d, _prompt_tokens(args, sample) if d.unit == "kv_tokens" else 0, sampling_params)
    url = await d.acquire(getattr(sample, "session_id", None), cost)
    try:
        return await original(_routed(args, url), sample, sampling_params)
    finally:
        d.release(url, cost)


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

"""Scoring a sample at its teacher: the request, the endpoint, the response's log-probs.

Teacher endpoints, in this order: the teacher's ``url``; a frozen model of that name in
``--sglang-config`` (slime's ``get_model_url``); else the *switched* engine(s) of
``ascend_opd_switch_engine_urls`` (:mod:`slime_ascend.opd.switching`).
"""

from __future__ import annotations

import inspect
import itertools
import math
import time
from collections.abc import Mapping
from typing import Any

from .context import OPDContext
from .teachers import TeacherSpec

def build_score_payload(args: Any, sample: Any, top_k: int | None = None) -> dict[str, Any]:
    """SGLang ``/generate`` request that scores ``sample.tokens`` without generating (as slime's OPD RM)."""
    payload: dict[str, Any] = {
        "input_ids": list(sample.tokens),
        "sampling_params": {
            "temperature": getattr(args, "rollout_temperature", 1.0),
            "max_new_tokens": 0,
            "skip_special_tokens": False,
        },
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if top_k:
        payload["top_logprobs_num"] = int(top_k)
    mm = getattr(sample, "multimodal_inputs", None)
    if mm and mm.get("images"):
        from slime.utils.processing_utils import encode_image_for_rollout_engine

        payload["image_data"] = [encode_image_for_rollout_engine(image) for image in mm["images"]]
    return payload

def meta_info(response: Mapping[str, Any], key: str, teacher: str, need: str) -> Any:
    """``response["meta_info"][key]``, else a ValueError naming the teacher and what its endpoint must honour."""
    try:
        return response["meta_info"][key]
    except (KeyError, TypeError):
        raise ValueError(f"teacher {teacher!r}: reply has no meta_info.{key}; {need}") from None

def response_teacher_log_probs(response: Mapping[str, Any], response_length: int, teacher: str = "?") -> list[float]:
    """``meta_info.input_token_logprobs[1:]`` (first element of each entry), last ``response_length``.

    This is exactly what slime's ``post_process_rewards`` keeps.
    """
    entries = meta_info(response, "input_token_logprobs", teacher, "the endpoint must be an SGLang /generate that "
                        "honours return_logprob and logprob_start_len=0")
    values = [item[0] for item in entries[1:]]
    if response_length > len(values):
        raise ValueError(
            f"teacher {teacher!r}: scored {len(values)} positions but the response has {response_length} tokens"
        )
    out = values[len(values) - response_length :] if response_length else []
    bad = [i for i, v in enumerate(out) if v is None or not math.isfinite(float(v))]
    if bad:
        raise ValueError(f"teacher {teacher!r}: non-finite log-prob at response position {bad[0]}")
    return [float(v) for v in out]

async def _post_json(url: str, payload: dict[str, Any], timeout_s: float, retries: int, ctx: OPDContext) -> Any:
    from ..json_client import arequest_json

    def count_retry() -> None:
        ctx.request_retries += 1

    return await arequest_json(url, payload, timeout_s=timeout_s, retries=retries, on_retry=count_retry)

def _teacher_url(args: Any, spec: TeacherSpec) -> str | None:
    if spec.url is not None:
        return spec.url.rstrip("/") + "/generate"
    routers = getattr(args, "sglang_model_routers", None) or {}
    if spec.name in routers:
        from slime.rollout.sglang_rollout import get_model_url

        return get_model_url(args, spec.name, "/generate")
    return None

def is_switched(args: Any, spec: TeacherSpec) -> bool:
    """The teacher has no endpoint of its own: it is scored on the switched engine(s), grouped per rollout."""
    return _teacher_url(args, spec) is None


_rr = itertools.count()

async def _request(args: Any, ctx: OPDContext, spec: TeacherSpec, sample: Any, url: str) -> Any:
    s = ctx.settings
    top_k = s["ascend_opd_topk"] if s["ascend_opd_mode"] == "topk" else None
    payload = build_score_payload(args, sample, top_k)
    t0 = time.perf_counter()
    resp = await _post_json(url, payload, s["ascend_opd_request_timeout_s"], s["ascend_opd_request_retries"], ctx)
    ctx.requests[spec.name] += 1
    ctx.request_s[spec.name] += time.perf_counter() - t0
    return resp

async def _score(args: Any, ctx: OPDContext, spec: TeacherSpec, sample: Any) -> Any:
    """Score ``sample`` at a teacher with its own endpoint (its url or its ``--sglang-config`` model)."""
    url = _teacher_url(args, spec)
    if url is None:
        raise RuntimeError(f"teacher {spec.name!r} is switched: its samples are scored by score_switched")
    return await _request(args, ctx, spec, sample, url)

async def score_switched(args: Any, ctx: OPDContext, items: list[tuple[TeacherSpec, Any]],
                         prefer: str | None = None) -> list[Any]:
    """Score ``(teacher, sample)`` pairs on the switched engine(s), grouped by teacher with the resident one
    first, then ``prefer`` (:func:`~slime_ascend.opd.switching.score_grouped`); each result is the reply or the
    exception it raised."""
    from .switching import score_grouped

    urls = ctx.settings["ascend_opd_switch_engine_urls"]
    if not urls:
        names = sorted({spec.name for spec, _ in items})
        raise RuntimeError(f"teachers {names} have no url, no --sglang-config model and no switched engine")

    def job(spec: TeacherSpec, sample: Any) -> Any:
        return lambda: _request(args, ctx, spec, sample, urls[next(_rr) % len(urls)].rstrip("/") + "/generate")

    return await score_grouped(ctx.gate(), [(spec.name, job(spec, sample)) for spec, sample in items],
                               prefetch=ctx.switcher.prefetch if ctx.switcher is not None else None,
                               prefer=prefer)

async def _task_reward(args: Any, ctx: OPDContext, sample: Any, **kwargs: Any) -> Any:
    path = ctx.settings["ascend_opd_task_rm_path"]
    if not path:
        return 0.0
    from ..plugins.base import resolve

    out = resolve(path)(args, sample, **kwargs)
    return await out if inspect.isawaitable(out) else out

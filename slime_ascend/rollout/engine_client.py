"""Async client for an SGLang-shaped ``/generate`` endpoint (token ids in, token ids + logprobs out).

The request is the one slime's default generate sends: ``{"input_ids", "sampling_params",
"return_logprob": True}``. The response is parsed from ``meta_info.output_token_logprobs``
(``[logprob, token_id, ...]`` per generated token), ``meta_info.finish_reason.type`` and
``meta_info.weight_version``.

The transport is injectable: pass ``post=`` an async callable ``payload -> response dict`` (a fake
engine in tests, or any other transport). The default is :func:`slime_ascend.json_client.arequest_json`
(``max_retries`` attempts).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import json_client

__all__ = ["EngineClient", "GenerationResult", "PostFn", "generate_url_from_args", "parse_generate_response"]

PostFn = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class GenerationResult:
    """One ``/generate`` answer: generated token ids with their rollout log-probs."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str | None = None
    text: str = ""
    meta_info: dict[str, Any] = field(default_factory=dict)


def generate_url_from_args(args: Any) -> str:
    """``http://{args.sglang_router_ip}:{args.sglang_router_port}/generate``."""
    ip = getattr(args, "sglang_router_ip", None)
    port = getattr(args, "sglang_router_port", None)
    if ip is None or port is None:
        raise ValueError(
            "args.sglang_router_ip and args.sglang_router_port are required to build the /generate URL; "
            "set them or pass url= explicitly"
        )
    return f"http://{ip}:{port}/generate"


def parse_generate_response(output: dict[str, Any]) -> GenerationResult:
    """Parse an SGLang ``/generate`` response dict into a :class:`GenerationResult`."""
    if not isinstance(output, dict) or "meta_info" not in output:
        raise ValueError(f"/generate response must be a dict with 'meta_info'; got {type(output).__name__}")
    meta = output["meta_info"]
    items = meta.get("output_token_logprobs")
    if items is None:
        raise ValueError(
            "/generate response has no meta_info.output_token_logprobs; send return_logprob=True "
            "(trainable tokens need rollout log-probs)"
        )
    token_ids = [int(item[1]) for item in items]
    log_probs = []
    for pos, item in enumerate(items):
        if item[0] is None:
            raise ValueError(f"/generate returned a null log-prob for output token {pos}")
        log_probs.append(float(item[0]))
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, dict) else finish
    if reason not in FINISH_REASONS:
        raise ValueError(f"/generate finish_reason must be one of {FINISH_REASONS}; got {finish!r}")
    version = meta.get("weight_version")
    return GenerationResult(
        token_ids=token_ids,
        log_probs=log_probs,
        finish_reason=reason,
        weight_version=None if version is None else str(version),
        text=output.get("text", "") or "",
        meta_info=meta,
    )


class EngineClient:
    """Calls ``/generate`` with token ids; ``post`` replaces the HTTP transport when given."""

    def __init__(self, url: str | None = None, *, post: PostFn | None = None, max_retries: int = 3) -> None:
        if url is None and post is None:
            raise ValueError("EngineClient needs url= (an SGLang /generate URL) or post= (an async transport)")
        if max_retries < 1:
            raise ValueError(f"max_retries must be >= 1; got {max_retries}")
        self.url = url
        self.max_retries = max_retries
        self._post = post

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        *,
        extra_payload: dict[str, Any] | None = None,
    ) -> GenerationResult:
        payload: dict[str, Any] = {
            "input_ids": [int(t) for t in input_ids],
            "sampling_params": dict(sampling_params),
            "return_logprob": True,
        }
        if extra_payload:
            payload.update(extra_payload)
        post = self._post or self._http_post
        return parse_generate_response(await post(payload))

    async def _http_post(self, payload: dict[str, Any]) -> dict[str, Any]:
        assert self.url is not None
        return await json_client.arequest_json(self.url, payload, retries=self.max_retries - 1, backoff_s=0.25)

    async def aclose(self) -> None:
        """Close the HTTP connections of the running event loop, if any."""
        await json_client.aclose()

"""One small JSON-over-HTTP client with retries, for every HTTP call slime-ascend makes itself.

:func:`request_json` blocks (stdlib ``urllib``: the teacher pool's weight switch, the demo's engine
calls); :func:`arequest_json` awaits (``httpx``, which every slime process has: teacher scoring and
``/generate`` from slime's rollout event loop). Both send ``payload`` as a JSON body (none: a GET)
and return the decoded JSON answer (an empty body is ``{}``). Connection errors, timeouts and 5xx
answers are retried ``retries`` times after ``min(backoff_s * 2**attempt, 5)`` seconds, calling
``on_retry()`` before each; a 4xx answer is not retried. The final failure raises
:class:`JSONRequestError` with the URL, the attempts, the status and the start of the answer. No
proxy from the environment is used: these are calls between the job's own processes.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["JSONRequestError", "aclose", "arequest_json", "request_json"]

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class JSONRequestError(RuntimeError):
    """An HTTP request failed after its retries; ``status`` is the last HTTP status (None: no answer)."""

    def __init__(self, url: str, attempts: int, message: str, status: int | None = None) -> None:
        super().__init__(f"request to {url} failed after {attempts} attempt(s): {message}")
        self.url, self.attempts, self.status = url, attempts, status


def _decode(raw: bytes) -> Any:
    return json.loads(raw) if raw.strip() else {}


def _delay(attempt: int, backoff_s: float) -> float:
    return min(backoff_s * 2**attempt, 5.0)


def _answer(status: int, raw: bytes) -> str:
    return f"HTTP {status}: {raw[:500].decode(errors='replace')}"


def request_json(url: str, payload: Any = None, *, timeout_s: float | None = 60.0, retries: int = 0,
                 backoff_s: float = 0.5, on_retry: Callable[[], None] | None = None) -> Any:
    """POST ``payload`` (GET when None) to ``url`` and return the decoded JSON answer."""
    data = None if payload is None else json.dumps(payload).encode()
    for attempt in range(retries + 1):
        req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with _OPENER.open(req, timeout=timeout_s) as resp:
                return _decode(resp.read())
        except urllib.error.HTTPError as exc:
            status, last = exc.code, _answer(exc.code, exc.read())
            if status < 500:
                break
        except OSError as exc:  # refused, reset, timed out
            status, last = None, f"{type(exc).__name__}: {exc}"
        if attempt < retries:
            if on_retry is not None:
                on_retry()
            time.sleep(_delay(attempt, backoff_s))
    raise JSONRequestError(url, attempt + 1, last, status)


# one connection pool per event loop (an httpx client cannot move between loops)
_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()


def _client() -> Any:
    import httpx

    loop = asyncio.get_running_loop()
    client = _CLIENTS.get(loop)
    if client is None or client.is_closed:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        client = _CLIENTS[loop] = httpx.AsyncClient(timeout=None, trust_env=False, limits=limits)
    return client


async def arequest_json(url: str, payload: Any = None, *, timeout_s: float | None = None, retries: int = 0,
                        backoff_s: float = 0.5, on_retry: Callable[[], None] | None = None) -> Any:
    """:func:`request_json` for an event loop (``timeout_s`` None: no limit)."""
    import httpx

    for attempt in range(retries + 1):
        try:
            if payload is None:
                resp = await _client().get(url, timeout=timeout_s)
            else:
                resp = await _client().post(url, json=payload, timeout=timeout_s)
            if resp.status_code < 400:
                return _decode(resp.content)
            status, last = resp.status_code, _answer(resp.status_code, resp.content)
            if status < 500:
                break
        except httpx.TransportError as exc:  # refused, reset, timed out
            status, last = None, f"{type(exc).__name__}: {exc}"
        if attempt < retries:
            if on_retry is not None:
                on_retry()
            await asyncio.sleep(_delay(attempt, backoff_s))
    raise JSONRequestError(url, attempt + 1, last, status)


async def aclose() -> None:
    """Close the running loop's connection pool, if any."""
    client = _CLIENTS.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.aclose()

"""One small JSON-over-HTTP client with retries, for every HTTP call slime-ascend makes itself.

:func:`request_json` blocks (stdlib ``urllib``: the teacher pool's weight switch, the demo's engine
calls); :func:`arequest_json` awaits (``httpx``, which every slime process has: teacher scoring and
``/generate`` from slime's rollout event loop). Both send ``payload`` as a JSON body (none: a GET)
and return the decoded JSON answer (an empty body is ``{}``). Connection errors, timeouts and 5xx
answers are retried ``retries`` times after ``min(backoff_s * 2**attempt, 5)`` seconds, calling
``on_retry()`` before each; a 4xx answer is not retried. The final failure raises
:class:`JSONRequestError` with the URL, the attempts, the status and the start of the answer. No
proxy from the environment is used: these are calls between the job's own processes.

``timeout_s`` bounds each socket operation (connecting, each read), so a server that trickles its
answer a byte at a time never trips it; ``deadline_s`` bounds the whole call: every attempt, the
waits between them and every byte of every answer. Past it the call stops (the blocking client shuts
its socket down, the async one cancels the request) and raises :class:`JSONRequestError` saying so.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
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


def _past_deadline(deadline_s: float) -> str:
    return f"no complete answer within {deadline_s:g} s (the request's deadline)"


def _left(end: float | None) -> float | None:
    return None if end is None else end - time.monotonic()


class _Watchdog:
    """Shuts an attempt's socket down at its deadline, so a read blocked on a trickling server returns."""

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        handlers = [_WatchedHTTP(), _WatchedHTTPS()]
        for handler in handlers:
            handler.watchdog = self
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), *handlers)
        self._timer = threading.Timer(max(seconds, 0.0), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            if self.expired:
                self._shutdown()

    def _fire(self) -> None:
        with self._lock:
            self.expired = True
            self._shutdown()

    def _shutdown(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed
                pass

    def cancel(self) -> None:
        self._timer.cancel()


class _Watched:
    """A urllib handler mixin: each connection it opens hands its socket to the handler's watchdog."""

    watchdog: _Watchdog

    def do_open(self, http_class: type, req: Any, **kwargs: Any) -> Any:
        dog = self.watchdog

        class Connection(http_class):  # type: ignore[misc, valid-type]
            def connect(self) -> None:
                super().connect()
                dog.watch(self.sock)

        return super().do_open(Connection, req, **kwargs)  # type: ignore[misc]


class _WatchedHTTP(_Watched, urllib.request.HTTPHandler):
    pass


class _WatchedHTTPS(_Watched, urllib.request.HTTPSHandler):
    pass


def request_json(url: str, payload: Any = None, *, timeout_s: float | None = 60.0, retries: int = 0,
                 backoff_s: float = 0.5, on_retry: Callable[[], None] | None = None,
                 deadline_s: float | None = None) -> Any:
    """POST ``payload`` (GET when None) to ``url`` and return the decoded JSON answer."""
    data = None if payload is None else json.dumps(payload).encode()
    end = None if deadline_s is None else time.monotonic() + deadline_s
    for attempt in range(retries + 1):
        req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                     headers={"Content-Type": "application/json"})
        left = _left(end)
        dog = None if left is None else _Watchdog(left)
        per_op = timeout_s if left is None else max(min(left, timeout_s or left), 1e-3)
        try:
            with (_OPENER if dog is None else dog.opener).open(req, timeout=per_op) as resp:
                raw = resp.read()
            if dog is None or not dog.expired:
                return _decode(raw)
        except urllib.error.HTTPError as exc:
            try:
                raw = exc.read()
            except (OSError, http.client.HTTPException):
                raw = b""
            status, last = exc.code, _answer(exc.code, raw)
            if status < 500 and not (dog is not None and dog.expired):
                break
        except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, cut short
            status, last = None, f"{type(exc).__name__}: {exc}"
        finally:
            if dog is not None:
                dog.cancel()
        if dog is not None and dog.expired:
            status, last = None, _past_deadline(deadline_s)
            break
        if attempt < retries:
            pause, left = _delay(attempt, backoff_s), _left(end)
            if left is not None and left <= pause:
                last = f"{last}; the next attempt would start past the {deadline_s:g} s deadline"
                break
            if on_retry is not None:
                on_retry()
            time.sleep(pause)
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
                        backoff_s: float = 0.5, on_retry: Callable[[], None] | None = None,
                        deadline_s: float | None = None) -> Any:
    """:func:`request_json` for an event loop (``timeout_s`` None: no limit)."""
    import httpx

    end = None if deadline_s is None else time.monotonic() + deadline_s
    for attempt in range(retries + 1):
        if payload is None:
            send = _client().get(url, timeout=timeout_s)
        else:
            send = _client().post(url, json=payload, timeout=timeout_s)
        try:
            resp = await asyncio.wait_for(send, _left(end))
            if resp.status_code < 400:
                return _decode(resp.content)
            status, last = resp.status_code, _answer(resp.status_code, resp.content)
            if status < 500:
                break
        except httpx.TransportError as exc:  # refused, reset, timed out
            status, last = None, f"{type(exc).__name__}: {exc}"
        except TimeoutError:  # asyncio.wait_for: the deadline passed
            status, last = None, _past_deadline(deadline_s)
            break
        if attempt < retries:
            pause, left = _delay(attempt, backoff_s), _left(end)
            if left is not None and left <= pause:
                last = f"{last}; the next attempt would start past the {deadline_s:g} s deadline"
                break
            if on_retry is not None:
                on_retry()
            await asyncio.sleep(pause)
    raise JSONRequestError(url, attempt + 1, last, status)


async def aclose() -> None:
    """Close the running loop's connection pool, if any."""
    client = _CLIENTS.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.aclose()

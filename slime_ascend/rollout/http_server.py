"""The HTTP server of SGLang's surface: serves :func:`~slime_ascend.rollout.sglang_protocol.routes` for any
:class:`~slime_ascend.rollout.sglang_protocol.SGLangEngine` (stdlib only; binds 127.0.0.1 unless told otherwise).

A thread per connection, and every connection bounded by a limit that names its flag
(``slime-ascend serve-torch`` and the vLLM adapter take the same flags, :func:`add_server_flags`):

* **receiving a request** (and idle between requests): each read waits at most ``--timeout`` s, and the whole
  request (request line, headers, body) must arrive within ``--request-timeout`` s of its first byte, so a
  client trickling one byte at a time is closed (408) however slowly it sends; headers larger than
  ``--max-header-bytes`` in all are 431, a ``Content-Length`` above ``--max-body-bytes`` is 413 before a byte of
  the body is read (no body is parsed that the limit refuses); at most ``--max-waiting-connections``
  connections wait at once: beyond, the one waiting longest is closed (503 if it had begun a request), so
  stalled clients cost threads but never keep an honest client out;
* **being served** (request received, answer not yet sent): at most ``--max-connections`` at once, plus
  ``CONTROL_CONNECTIONS`` for everything but ``WORK_PATHS`` (slime's pause, weight update and health calls
  reach an engine whose slots its own rollout has filled: slime's fully-async worker keeps 512 requests per
  engine open); beyond, 503. Sending an answer may take at most ``--timeout`` s;
* the listen backlog is ``--backlog`` (a burst of hundreds of clients is queued, not reset); a ``/generate``
  whose client disconnects is aborted at the engine's next decode step; an unexpected failure answers 500 and
  the server keeps running. Per-request work limits live on the engines.
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import logging
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from .sglang_protocol import WORK_PATHS, HeldAnswer, RequestError, SGLangEngine, check_positive_ints, routes

__all__ = ["CONTROL_CONNECTIONS", "BoundedThreadingHTTPServer", "add_server_flags", "make_server", "positive_float",
           "positive_int", "serve_until_interrupted", "server_options"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0  # one read (idle between requests, a stall mid-request) and sending one answer
DEFAULT_REQUEST_TIMEOUT_S = 30.0  # one whole request, from its first byte
DEFAULT_BACKLOG = 1024
DEFAULT_MAX_CONNECTIONS = 512  # requests served at once
DEFAULT_MAX_WAITING_CONNECTIONS = 1024  # connections receiving a request or idle
DEFAULT_MAX_HEADER_BYTES = 64 * 1024  # request line and headers (the stdlib alone allows 100 lines of 64 KiB)
# 4x the JSON of a full --max-prompt-tokens batch (131072 ids of 6 digits: 1 MiB); parsing a body costs up to
# ~25x its size in Python objects, so this is the bound on what one request can make the server allocate
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
CONTROL_CONNECTIONS = 16  # served beyond --max-connections, for every route but WORK_PATHS
LINGER_S = 2.0  # after a 408/413/431, unread input discarded for at most this long (so the client reads the refusal)


class HeadersTooLarge(http.client.HTTPException):
    """The request line and headers passed ``--max-header-bytes`` (the stdlib answers it 431)."""


class _Evicted(ConnectionAbortedError):
    """The server closed this waiting connection to make room for a newer one."""


class _Connection:
    """One open connection: its socket, the slot it holds while served, whether it was closed for room."""

    __slots__ = ("evicted", "slot", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.slot, self.evicted = sock, None, False


class _DeadlineReader(io.RawIOBase):
    """The socket's bytes, each read waiting at most ``idle`` s and none ending later than ``deadline`` s after
    the current request's first byte (a per-read timeout alone lets one byte a second hold a thread forever)."""

    def __init__(self, conn: _Connection, idle: float | None, deadline: float | None) -> None:
        super().__init__()
        self.conn, self.idle, self.deadline = conn, idle, deadline
        self.started: float | None = None  # monotonic time of the current request's first byte
        self.expired = False  # a read of a begun request timed out

    def readable(self) -> bool:
        return True

    def begin_request(self) -> None:
        self.started, self.expired = None, False

    def readinto(self, buffer: Any) -> int:
        timeout = self.idle
        if self.started is not None and self.deadline is not None:
            left = self.started + self.deadline - time.monotonic()
            if left <= 0:
                self.expired = True
                raise TimeoutError(f"request not received within {self.deadline} s (--request-timeout)")
            timeout = left if timeout is None else min(timeout, left)
        self.conn.sock.settimeout(timeout)
        try:
            n = self.conn.sock.recv_into(buffer)
        except TimeoutError:
            self.expired = self.started is not None
            raise
        if self.conn.evicted:
            raise _Evicted
        if n and self.started is None:
            self.started = time.monotonic()
        return n


class _RequestFile(io.BufferedReader):
    """The buffered request stream; ``readline`` (the request line and header lines, never the body) spends
    the budget :meth:`begin_request` set and raises :class:`HeadersTooLarge` past it."""

    def begin_request(self, max_header_bytes: int) -> None:
        self.raw.begin_request()
        self.header_limit = self.header_budget = max_header_bytes

    def readline(self, size: int | None = -1) -> bytes:
        cap = self.header_budget + 1
        line = super().readline(cap if size is None or size < 0 else min(size, cap))
        self.header_budget -= len(line)
        if self.header_budget < 0:
            raise HeadersTooLarge(f"request line and headers larger than this server's limit of {self.header_limit} "
                                  "bytes (raise it with --max-header-bytes)")
        return line


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "slime-ascend"
    routes: dict[tuple[str, str], Callable[..., tuple[int, Any]]] = {}
    timeout: float | None = DEFAULT_TIMEOUT_S
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S
    max_header_bytes = DEFAULT_MAX_HEADER_BYTES
    max_body_bytes = DEFAULT_MAX_BODY_BYTES
    server: BoundedThreadingHTTPServer

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the stdlib's makefile: replaced by the deadline-keeping stream
        self._reader = _DeadlineReader(self.server.connection(self.request), self.timeout, self.request_timeout)
        self.rfile = _RequestFile(self._reader)
        self._linger = False

    def finish(self) -> None:
        super().finish()
        if self._linger:
            self._discard_input()

    def _discard_input(self) -> None:
        """A lingering close (as nginx's): after refusing a request whose bytes were left unread (408, 413, 431),
        read and drop what the client still sends, at most ``LINGER_S`` s, so it reads the refusal, not a reset."""
        try:
            self.connection.shutdown(socket.SHUT_WR)  # the refusal, then end of stream
            end = time.monotonic() + LINGER_S
            while (left := end - time.monotonic()) > 0:
                self.connection.settimeout(left)
                if not self.connection.recv(65536):
                    return
        except OSError:
            pass

    def handle_one_request(self) -> None:
        self.rfile.begin_request(self.max_header_bytes)
        self.requestline, self.request_version, self.command = "", "", ""  # until parse_request sets them
        self._answered = False
        try:
            super().handle_one_request()  # a timed-out read ends it quietly (the stdlib catches TimeoutError)
        except HeadersTooLarge as exc:  # in the request line (parse_request answers header lines itself)
            self.send_error(431, explain=str(exc))
        except _Evicted:
            self.close_connection = True
            if self._reader.started is not None:
                self.send_error(503, explain=self.server.evicted_message())
        if self._reader.expired and not self._answered:
            self.send_error(408, explain=f"request not received within {self.request_timeout} s "
                            f"(--request-timeout) or stalled for {self.timeout} s (--timeout)")

    def client_disconnected(self) -> bool:
        """True once the client has closed or reset its connection (never blocks; poll, not select,
        so descriptors above 1024 work)."""
        try:
            poller = select.poll()
            poller.register(self.connection, select.POLLIN | select.POLLHUP | select.POLLERR)
            if not poller.poll(0):
                return False
            return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except (OSError, ValueError):
            return True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        logger.debug("%s - %s", self.address_string(), format % args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's own refusals (a bad request line, 431, 414, 501) in this server's JSON shape."""
        self.close_connection = True
        self._send(code, {"error": explain or message or self.responses.get(code, ("", ""))[1], "success": False})

    def _send(self, status: int, body: Any, retry_after: int | None = None) -> None:
        """Answer ``body`` as JSON; a :class:`HeldAnswer`'s budget is released once it is sent (or failed to)."""
        self._answered = True
        self._linger = self._linger or status in (408, 413, 431)  # refused before its bytes were read
        held = body if isinstance(body, HeldAnswer) else None
        try:
            data = json.dumps(body if held is None else held.value).encode()
            try:
                self.connection.settimeout(self.timeout)  # the whole answer within --timeout (sendall's total)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if retry_after is not None:
                    self.send_header("Retry-After", str(retry_after))
                if self.close_connection:  # tell the client, so it does not reuse a connection we are closing
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # client gone or stalled past the timeout; nothing left to tell it
                self.close_connection = True
        finally:
            if held is not None:
                held.release()

    def _refuse(self, exc: RequestError) -> None:
        self._send(exc.status, {"error": str(exc), "success": False}, retry_after=exc.retry_after)

    def _read_body(self) -> dict[str, Any]:
        length_header = self.headers.get("Content-Length")
        try:
            length = int(length_header) if length_header is not None else 0
        except ValueError as exc:
            raise RequestError("invalid Content-Length header") from exc
        if length < 0:
            raise RequestError("invalid Content-Length header")
        if length > self.max_body_bytes:
            raise RequestError(
                f"request body of {length} bytes is larger than this server's limit of {self.max_body_bytes} "
                "(raise it with --max-body-bytes)",
                status=413,
            )
        try:
            raw = self.rfile.read(length) if length else b""
        except TimeoutError:
            raise RequestError(f"request body not received within {self.request_timeout} s (--request-timeout) "
                               f"or stalled for {self.timeout} s (--timeout)", status=408) from None
        except _Evicted:
            raise RequestError(self.server.evicted_message(), status=503) from None
        if len(raw) < length:
            raise RequestError(f"request body ended after {len(raw)} of {length} bytes (Content-Length)")
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except RecursionError:
            raise RequestError("request body is nested too deeply; send a flat JSON object") from None
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, and ints past Python's digit limit
            raise RequestError(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
        return body

    def _dispatch(self) -> None:
        method = self.command
        path = urlsplit(self.path).path.rstrip("/") or "/"
        try:
            try:
                body = self._read_body()
            except RequestError:
                self.close_connection = True  # the body may be unread; do not reuse the connection
                raise
            refusal = self.server.begin_serving(self.request, path)
            if refusal is not None:
                self.close_connection = True
                self._send(503, {"error": refusal, "success": False})
                return
            try:
                self._serve(method, path, body)
            finally:
                if not self.server.end_serving(self.request, keep_alive=not self.close_connection):
                    self.close_connection = True
        except RequestError as exc:
            self._refuse(exc)

    def _serve(self, method: str, path: str, body: dict[str, Any]) -> None:
        try:
            handler = self.routes.get((method, path))
            if handler is None:
                known = any(p == path for _, p in self.routes)
                raise RequestError(
                    f"{method} {path} is not allowed" if known else f"no endpoint {path}", status=405 if known else 404
                )
            if getattr(handler, "needs_client", False):
                status, result = handler(body, self.client_disconnected)
            else:
                status, result = handler(body)
            self._send(status, result)
        except RequestError as exc:
            self._refuse(exc)
        except Exception as exc:  # noqa: BLE001 - keep serving; report the failure to the client
            logger.exception("%s failed on %s %s", self.server_version, method, path)
            self._send(500, {"error": f"{type(exc).__name__}: {exc}", "success": False})

    # the stdlib calls do_<METHOD>; each goes through the route table (405 where a path has no such method)
    do_GET = do_POST = do_PUT = do_DELETE = _dispatch


class BoundedThreadingHTTPServer(ThreadingHTTPServer):
    """A thread per connection; at most ``max_waiting`` connections receiving a request or idle (the longest
    waiting is closed for a newer one) and ``max_connections`` being served, plus ``CONTROL_CONNECTIONS``
    for everything but ``WORK_PATHS`` (503 beyond); a ``backlog`` deep accept queue."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, backlog: int, max_connections: int,
                 max_waiting: int) -> None:
        self.request_queue_size = backlog  # socketserver passes it to listen(); the stdlib default is 5
        self.max_connections, self.max_waiting = max_connections, max_waiting
        self._lock = threading.Lock()
        self._open: dict[int, _Connection] = {}  # id(socket) -> its connection
        self._waiting: dict[int, _Connection] = {}  # the waiting ones, longest waiting first
        self._serving = {"work": 0, "control": 0}
        super().__init__(address, handler)

    def busy_message(self) -> str:
        return f"server busy: {self.max_connections} requests being served (--max-connections)"

    def evicted_message(self) -> str:
        return (f"connection closed: {self.max_waiting} connections were waiting to send a request "
                "(--max-waiting-connections) and this one had waited longest; send the request whole, then retry")

    def connection(self, request: Any) -> _Connection:
        with self._lock:
            return self._open[id(request)]

    def _wait(self, conn: _Connection) -> None:
        """``conn`` waits for its next request (lock held); the longest waiting is closed when too many wait."""
        self._waiting[id(conn.sock)] = conn
        if len(self._waiting) > self.max_waiting:
            oldest = self._waiting.pop(next(iter(self._waiting)))
            oldest.evicted = True
            try:  # wakes its thread's read; the write side stays open for its 503
                oldest.sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass

    def begin_serving(self, request: Any, path: str) -> str | None:
        """Take a serving slot for ``request``'s connection (None), or the reason it gets none (a 503)."""
        with self._lock:
            conn = self._open[id(request)]
            if conn.evicted:
                return self.evicted_message()
            if self._serving["work"] < self.max_connections:
                conn.slot = "work"
            elif path not in WORK_PATHS and self._serving["control"] < CONTROL_CONNECTIONS:
                conn.slot = "control"
            else:
                return self.busy_message()
            self._serving[conn.slot] += 1
            self._waiting.pop(id(request), None)
            return None

    def end_serving(self, request: Any, keep_alive: bool) -> bool:
        """Release ``request``'s slot; a kept-alive connection waits for its next request. False: close it."""
        with self._lock:
            conn = self._open[id(request)]
            self._release(conn)
            if conn.evicted or not keep_alive:
                return False
            self._wait(conn)
            return True

    def _release(self, conn: _Connection) -> None:
        if conn.slot is not None:
            self._serving[conn.slot] -= 1
            conn.slot = None

    def process_request(self, request: Any, client_address: Any) -> None:
        conn = _Connection(request)
        with self._lock:
            self._open[id(request)] = conn
            self._wait(conn)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:  # forgotten before the socket closes: an eviction never shuts down a reused descriptor
            conn = self._open.pop(id(request), None)
            self._waiting.pop(id(request), None)
            if conn is not None:
                self._release(conn)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone mid-answer is routine (debug); anything else is logged with its traceback, not printed."""
        failure = sys.exc_info()[1]
        level = logging.DEBUG if isinstance(failure, OSError) else logging.ERROR
        logger.log(level, "connection from %s ended with an error", client_address, exc_info=True)


def make_server(
    engine: SGLangEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S,
    backlog: int = DEFAULT_BACKLOG,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    max_waiting_connections: int = DEFAULT_MAX_WAITING_CONNECTIONS,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> BoundedThreadingHTTPServer:
    """A bound (not yet serving) threaded HTTP server for ``engine``; ``port=0`` picks a free port. The
    keywords are the limits of the module docstring (``timeout``/``request_timeout`` None: none)."""
    for name, value in (("timeout", timeout), ("request_timeout", request_timeout)):
        if value is not None and not 0 < value < float("inf"):
            raise ValueError(f"{name} must be > 0 seconds or None, got {value!r}")
    check_positive_ints(backlog=backlog, max_connections=max_connections,
                        max_waiting_connections=max_waiting_connections, max_header_bytes=max_header_bytes,
                        max_body_bytes=max_body_bytes)
    handler = type(
        "SGLangSurfaceHandler",
        (_Handler,),
        {"routes": routes(engine), "timeout": timeout, "request_timeout": request_timeout,
         "max_header_bytes": max_header_bytes, "max_body_bytes": max_body_bytes,
         "server_version": f"slime-ascend ({engine.engine_name})"},
    )
    return BoundedThreadingHTTPServer((host, port), handler, backlog=backlog, max_connections=max_connections,
                                      max_waiting=max_waiting_connections)


def serve_until_interrupted(server: ThreadingHTTPServer) -> None:
    """Serve until Ctrl-C, then close the listening socket."""
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def _positive(convert: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    """An argparse ``type``: ``convert(text)`` when it is above 0 and finite, else an error naming ``what``."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = 0
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"expected a positive {what}, got {text!r}")
        return value

    return parse


positive_int = _positive(int, "integer")
positive_float = _positive(float, "number of seconds")

# flag -> (make_server keyword, type, default, help)
_SERVER_FLAGS: dict[str, tuple[str, Callable[[str], Any], Any, str]] = {
    "--timeout": ("timeout", positive_float, DEFAULT_TIMEOUT_S,
                  "seconds one read may wait (idle between requests, a stall mid-request) and one answer may take "
                  "to send"),
    "--request-timeout": ("request_timeout", positive_float, DEFAULT_REQUEST_TIMEOUT_S,
                          "seconds a whole request (request line, headers, body) may take from its first byte"),
    "--backlog": ("backlog", positive_int, DEFAULT_BACKLOG, "listen backlog: connections queued before accept"),
    "--max-connections": ("max_connections", positive_int, DEFAULT_MAX_CONNECTIONS,
                          "requests served at once; more get 503 (16 more for everything but /generate)"),
    "--max-waiting-connections": ("max_waiting_connections", positive_int, DEFAULT_MAX_WAITING_CONNECTIONS,
                                  "connections receiving a request or idle; beyond, the longest waiting is closed"),
    "--max-header-bytes": ("max_header_bytes", positive_int, DEFAULT_MAX_HEADER_BYTES,
                           "largest request line and headers in bytes, in all (431 beyond)"),
    "--max-body-bytes": ("max_body_bytes", positive_int, DEFAULT_MAX_BODY_BYTES,
                         "largest request body in bytes, refused from Content-Length before it is read (413)"),
}


def add_server_flags(group: argparse._ActionsContainer) -> None:
    """The server limits as flags (``--timeout`` ... ``--max-body-bytes``) of a server command."""
    for flag, (_, kind, default, text) in _SERVER_FLAGS.items():
        group.add_argument(flag, type=kind, default=default, help=f"{text} (default %(default)s)")


def server_options(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`make_server`'s keywords from the flags :func:`add_server_flags` added."""
    return {keyword: getattr(args, keyword) for keyword, *_ in _SERVER_FLAGS.values()}

"""SGLang-compatible HTTP surface for :class:`ReferenceEngine` (stdlib ``http.server`` only).

Endpoints (the ones slime's rollout, external-engine discovery and weight sync call):

* ``POST /generate``; ``GET|POST /health``, ``/health_generate``
* ``GET /server_info``, ``/get_server_info``, ``/get_model_info``, ``/model_info``, ``/get_weight_version``,
  ``/v1/loads``
* ``POST /update_weights_from_disk``, ``/pause_generation``, ``/continue_generation``, ``/abort_request``
* ``GET|POST /flush_cache``; no-op ``POST /release_memory_occupation``, ``/resume_memory_occupation``,
  ``/post_process_weights``
* ``POST /update_weights_from_distributed``, ``/update_weights_from_tensor``, ``/init_weights_update_group``:
  501 (disk sync only).

Client errors answer 4xx with ``{"error": message}``; an unexpected failure answers 500 and the
server keeps running. Binds 127.0.0.1 unless told otherwise.

Bounded per server: a connection idle or stalled mid-request for ``timeout`` seconds is closed (408
when a body was being read); at most ``max_connections`` connections are served at once (503 beyond,
so stalled clients cannot hold unbounded threads); the listen backlog is ``backlog`` (a burst of
hundreds of concurrent clients is queued, not reset); bodies are at most ``max_body_bytes``; a
``/generate`` whose client disconnects is aborted at the next decode step. Per-request limits live
on the engine (``--max-batch-size``, ``--max-prompt-tokens``, ``--max-new-tokens``).
"""

from __future__ import annotations

import argparse
import json
import logging
import select
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from slime_ascend.rollout import reference_engine as _engine_mod
from slime_ascend.rollout.reference_engine import ReferenceEngine, RequestError

__all__ = ["main", "make_server", "serve_reference"]

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_BACKLOG = 1024
DEFAULT_MAX_CONNECTIONS = 512

_UNSUPPORTED_SYNC = (
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
)


def _routes(engine: ReferenceEngine) -> dict[tuple[str, str], Callable[[dict[str, Any]], tuple[int, Any]]]:
    def ok(value: Any) -> tuple[int, Any]:
        return 200, value

    def health(_: dict) -> tuple[int, Any]:
        return 200, {"status": "ok"}

    def health_generate(_: dict) -> tuple[int, Any]:
        return (200, {"status": "ok"}) if engine.health_generate() else (503, {"error": "non-finite logits"})

    def update_from_disk(body: dict) -> tuple[int, Any]:
        if "model_path" not in body:
            raise RequestError("update_weights_from_disk needs 'model_path'")
        extra = {k: body[k] for k in ("weight_version", "load_format") if k in body}
        return ok(engine.update_weights_from_disk(body["model_path"], **extra))

    def pause(body: dict) -> tuple[int, Any]:
        return ok(engine.pause_generation(body.get("mode", "abort")))

    def abort(body: dict) -> tuple[int, Any]:
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if rid is not None and not isinstance(rid, str):
            raise RequestError("rid must be a string")
        if not isinstance(abort_all, bool):
            raise RequestError("abort_all must be true or false")
        return ok(engine.abort_request(rid=rid, abort_all=abort_all))

    def noop(body: dict) -> tuple[int, Any]:
        return ok({"success": True, "message": "no-op on the CPU reference engine"})

    def unsupported(body: dict) -> tuple[int, Any]:
        return 501, {
            "success": False,
            "error": "the reference engine supports disk weight sync only (--update-weight-transport disk)",
        }

    def generate(body: dict, is_disconnected: Callable[[], bool] | None = None) -> tuple[int, Any]:
        return ok(engine.generate(body, is_disconnected=is_disconnected))

    generate.needs_client = True  # type: ignore[attr-defined]  # _dispatch passes the disconnect probe

    routes: dict[tuple[str, str], Callable[[dict[str, Any]], tuple[int, Any]]] = {
        ("POST", "/generate"): generate,
        ("POST", "/update_weights_from_disk"): update_from_disk,
        ("POST", "/pause_generation"): pause,
        ("POST", "/continue_generation"): lambda body: ok(engine.continue_generation()),
        ("POST", "/abort_request"): abort,
        ("GET", "/get_weight_version"): lambda body: ok({"weight_version": engine.weight_version}),
        ("GET", "/get_model_info"): lambda body: ok(engine.model_info()),
        ("GET", "/model_info"): lambda body: ok(engine.model_info()),  # the name sglang's router tries first
        ("GET", "/server_info"): lambda body: ok(engine.server_info()),
        ("GET", "/get_server_info"): lambda body: ok(engine.server_info()),
        ("GET", "/v1/loads"): lambda body: ok(engine.loads()),
        ("POST", "/release_memory_occupation"): noop,
        ("POST", "/resume_memory_occupation"): noop,
        ("POST", "/post_process_weights"): noop,
    }
    for method in ("GET", "POST"):
        routes[(method, "/health")] = health
        routes[(method, "/health_generate")] = health_generate
        routes[(method, "/flush_cache")] = lambda body: ok(engine.flush_cache())
    for path in _UNSUPPORTED_SYNC:
        routes[("POST", path)] = unsupported
    return routes


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "slime-ascend-reference"
    routes: dict[tuple[str, str], Callable[[dict[str, Any]], tuple[int, Any]]] = {}
    max_body_bytes = MAX_BODY_BYTES

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

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:  # tell the client, so it does not reuse a connection we are closing
            self.send_header("Connection", "close")
        self.end_headers()
        try:
            self.wfile.write(data)
        except OSError:  # client gone or stalled past the timeout; nothing left to tell it
            self.close_connection = True

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
            raise RequestError(f"request body not received within {self.timeout} s", status=408) from None
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

    def _dispatch(self, method: str) -> None:
        path = urlsplit(self.path).path.rstrip("/") or "/"
        try:
            try:
                body = self._read_body()
            except RequestError:
                self.close_connection = True  # the body may be unread; do not reuse the connection
                raise
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
            self._send(exc.status, {"error": str(exc), "success": False})
        except Exception as exc:  # noqa: BLE001 - keep serving; report the failure to the client
            logger.exception("reference engine failed on %s %s", method, path)
            self._send(500, {"error": f"{type(exc).__name__}: {exc}", "success": False})

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802 - stdlib naming
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802 - stdlib naming
        self._dispatch("PUT")

    def do_DELETE(self) -> None:  # noqa: N802 - stdlib naming
        self._dispatch("DELETE")


class BoundedThreadingHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once (503 and close beyond), listening
    with a ``backlog`` deep accept queue."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, backlog: int, max_connections: int) -> None:
        self.request_queue_size = backlog  # socketserver passes it to listen(); the stdlib default is 5
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            body = json.dumps(
                {"success": False, "error": f"server busy: {self.max_connections} connections open (--max-connections)"}
            ).encode()
            try:
                request.settimeout(1.0)
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                )
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def make_server(
    engine: ReferenceEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    backlog: int = DEFAULT_BACKLOG,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> ThreadingHTTPServer:
    """A bound (not yet serving) threaded HTTP server for ``engine``; ``port=0`` picks a free port.

    ``timeout``: seconds a connection may sit idle or stalled mid-request (None: forever);
    ``backlog``: listen queue; ``max_connections``: connections served at once; ``max_body_bytes``:
    largest request body.
    """
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
    for name, value in (("backlog", backlog), ("max_connections", max_connections), ("max_body_bytes", max_body_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    handler = type(
        "ReferenceEngineHandler",
        (_Handler,),
        {"routes": _routes(engine), "timeout": timeout, "max_body_bytes": max_body_bytes},
    )
    return BoundedThreadingHTTPServer((host, port), handler, backlog=backlog, max_connections=max_connections)


def main(
    model: str | None = None,
    host: str = "127.0.0.1",
    port: int = 30000,
    seed: int = 0,
    dtype: str = "float32",
    *,
    max_batch_size: int = _engine_mod.DEFAULT_MAX_BATCH_SIZE,
    max_prompt_tokens: int = _engine_mod.DEFAULT_MAX_PROMPT_TOKENS,
    max_new_tokens: int = _engine_mod.DEFAULT_MAX_NEW_TOKENS_LIMIT,
    **server_kwargs: Any,
) -> None:
    """Load the engine and serve it until interrupted (``server_kwargs`` go to :func:`make_server`)."""
    engine = ReferenceEngine(
        model_path=model,
        dtype=dtype,
        seed=seed,
        max_batch_size=max_batch_size,
        max_prompt_tokens=max_prompt_tokens,
        max_new_tokens=max_new_tokens,
    )
    server = make_server(engine, host=host, port=port, **server_kwargs)
    bound_host, bound_port = server.server_address[:2]
    print(f"reference engine serving {engine.server_info()['model_path']} at http://{bound_host}:{bound_port}", flush=True)
    serve_until_interrupted(server)


def serve_until_interrupted(server: ThreadingHTTPServer) -> None:
    """Serve until Ctrl-C, then close the listening socket."""
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slime-ascend serve-reference",
        description="Serve a CPU torch+transformers model over SGLang's HTTP API (reference rollout engine).",
    )
    parser.add_argument("--model", default=None, help="HF safetensors checkpoint dir (default: tiny random Qwen3)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000, help="port (0 picks a free one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    limits = parser.add_argument_group("limits (bounded work per request and per server)")
    limits.add_argument("--max-batch-size", type=_positive_int, default=_engine_mod.DEFAULT_MAX_BATCH_SIZE,
                        help="most prompts in one /generate request (default %(default)s)")
    limits.add_argument("--max-prompt-tokens", type=_positive_int, default=_engine_mod.DEFAULT_MAX_PROMPT_TOKENS,
                        help="most prompt tokens in one /generate request, summed over a batch (default %(default)s)")
    limits.add_argument("--max-new-tokens", type=_positive_int, default=_engine_mod.DEFAULT_MAX_NEW_TOKENS_LIMIT,
                        help="highest sampling_params.max_new_tokens accepted (default %(default)s)")
    limits.add_argument("--timeout", type=_positive_float, default=DEFAULT_TIMEOUT_S,
                        help="seconds a connection may sit idle or stalled mid-request (default %(default)s)")
    limits.add_argument("--backlog", type=_positive_int, default=DEFAULT_BACKLOG,
                        help="listen backlog: connections queued before accept (default %(default)s)")
    limits.add_argument("--max-connections", type=_positive_int, default=DEFAULT_MAX_CONNECTIONS,
                        help="connections served at once; more get 503 (default %(default)s)")
    limits.add_argument("--max-body-bytes", type=_positive_int, default=MAX_BODY_BYTES,
                        help="largest request body in bytes (default %(default)s)")
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def serve_reference(argv: list[str] | None = None) -> int:
    """CLI entry: ``slime-ascend serve-reference --model DIR --host 127.0.0.1 --port PORT``."""
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:  # the engine's own events (weight updates) on stderr
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    main(
        model=args.model,
        host=args.host,
        port=args.port,
        seed=args.seed,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens,
        timeout=args.timeout,
        backlog=args.backlog,
        max_connections=args.max_connections,
        max_body_bytes=args.max_body_bytes,
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(serve_reference())

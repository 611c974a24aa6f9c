"""SGLang's HTTP surface, served for any engine that implements :class:`SGLangEngine` (stdlib only).

One route table for the CPU reference engine (:mod:`slime_ascend.rollout.reference.engine`) and the
vLLM adapter (:mod:`slime_ascend.rollout.backends.vllm_ascend`); ``slime-ascend serve-reference`` is
:func:`serve_reference`. Endpoints (the ones slime's rollout, external-engine discovery and weight
sync call):

* ``POST /generate``; ``GET|POST /health``, ``/health_generate``
* ``GET /server_info``, ``/get_server_info``, ``/get_model_info``, ``/model_info``, ``/get_weight_version``,
  ``/v1/loads``
* ``POST /update_weights_from_disk``, ``/pause_generation``, ``/continue_generation``, ``/abort_request``
* ``GET|POST /flush_cache``; ``POST /release_memory_occupation``, ``/resume_memory_occupation`` (a no-op
  for an engine without them), ``/post_process_weights`` (a no-op)
* ``POST /update_weights_from_distributed``, ``/update_weights_from_tensor``, ``/init_weights_update_group``,
  ``/destroy_weights_update_group``: 501 (disk sync only).
* ``POST /tokenize``, ``/v1/tokenize`` for an engine with a ``tokenize`` method (the reference engine;
  the OPD teacher check asks a remote teacher's engine through it): SGLang's request and answer.

Client errors (:class:`RequestError`, the one error type of both engines) answer 4xx/5xx with
``{"error": message, "success": false}``; an unexpected failure answers 500 and the server keeps
running. Binds 127.0.0.1 unless told otherwise. :func:`check_generate_keys` is the shared refusal of
``/generate`` fields an engine would not honour (slime's router adds some at neutral values).

Bounded per server: a connection idle or stalled mid-request for ``timeout`` seconds is closed (408
when a body was being read); at most ``max_connections`` connections are served at once (503 beyond,
so stalled clients cannot hold unbounded threads), plus ``CONTROL_CONNECTIONS`` more that serve every
endpoint but ``/generate`` (slime's pause, weight update and health calls still reach an engine whose
connections its own rollout has filled: slime's fully-async worker keeps 512 requests per engine open); the listen backlog is ``backlog`` (a burst of
hundreds of concurrent clients is queued, not reset); bodies are at most ``max_body_bytes``; a
``/generate`` whose client disconnects is aborted at the next decode step. Per-request limits live
on the engine (``--max-batch-size``, ``--max-prompt-tokens``, ``--max-new-tokens``, ``--max-top-logprobs``).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import select
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import urlsplit

__all__ = ["ONE_SERVER_INFO", "RequestError", "SGLangEngine", "abort_matches", "check_generate_keys",
           "check_positive_ints", "check_weight_version", "make_server", "next_weight_version", "serve_reference", "serve_until_interrupted"]

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

# Top-level /generate keys accepted only when falsy (SGLang features no engine here implements).
NEUTRAL_REQUEST_KEYS = frozenset({
    "stream", "image_data", "video_data", "audio_data", "input_embeds", "return_routed_experts", "lora_path",
    "custom_logit_processor", "token_ids_logprob", "session_params", "return_hidden_states", "bootstrap_host",
    "bootstrap_port", "bootstrap_room", "data_parallel_rank", "priority",
})
# Keys slime's sglang router adds when it re-serialises a /generate body, with the values that leave
# the result unchanged (compared with ``is``: JSON true/false/null only). Any other value is a 400.
ROUTER_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "model": (None,),
    "no_logs": (False,),
    "return_bytes": (False,),
    "return_entropy": (False,),
    "log_metrics": (True, False),  # only decides whether SGLang records metrics
}


class RequestError(ValueError):
    """A client (4xx) or upstream (5xx) error: the server answers it with ``status`` and ``{"error": message}``."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


# /server_info fields of an engine that is one unsharded server (slime's external-engine discovery reads them)
ONE_SERVER_INFO = {"pp_size": 1, "dp_size": 1, "ep_size": 1, "enable_memory_saver": False,
                   "disaggregation_mode": "null"}


def check_positive_ints(**values: Any) -> None:
    """ValueError naming the first of ``values`` that is not a positive integer (a bool is not one)."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


WEIGHT_VERSION = re.compile(r"[A-Za-z0-9._:+-]{1,128}")


def check_weight_version(requested: Any) -> str | None:
    """``requested`` as the version string to store (None: not given), or :class:`RequestError`: a non-negative
    integer or a word of at most 128 letters, digits and ``._:+-`` (slime sends ``str(int)``); an empty,
    boolean, negative or oversized value would be stored and reported back as given."""
    if requested is None:
        return None
    if isinstance(requested, int) and not isinstance(requested, bool) and requested >= 0:
        return str(requested)
    if isinstance(requested, str) and WEIGHT_VERSION.fullmatch(requested):
        return requested
    shown = repr(requested) if len(repr(requested)) <= 40 else repr(requested)[:40] + "..."
    raise RequestError(f"weight_version must be a non-negative integer or a word of at most 128 letters, digits "
                       f"and ._:+- (slime sends str(int)), got {shown}")


def next_weight_version(current: str, requested: Any = None) -> str:
    """The version after a weight update: ``requested`` when given (checked by :func:`check_weight_version`),
    else ``current`` + 1 when it is a number, else ``"1"`` (SGLang keeps the old version; both engines here
    count instead)."""
    requested = check_weight_version(requested)
    if requested is not None:
        return requested
    return str(int(current) + 1) if current.isdigit() else "1"


def abort_matches(candidate: str, rid: str | None, abort_all: bool) -> bool:
    """SGLang's ``/abort_request`` match: every request, or ``rid`` and its batch's ids ``rid_<i>``."""
    return abort_all or (rid is not None and (candidate == rid or candidate.startswith(f"{rid}_")))


class SGLangEngine(Protocol):
    """What :func:`make_server` serves: SGLang's endpoint semantics as methods (dicts in, dicts out;
    :class:`RequestError` for a refused request). ``engine_name`` names it in messages. Optional:
    ``release_memory_occupation()`` and ``resume_memory_occupation(tags)`` (absent: a no-op), and
    ``tokenize(body)`` (absent: no ``/tokenize`` route, a 404 as from a server without it)."""

    engine_name: str
    weight_version: str

    def generate(self, payload: dict[str, Any], is_disconnected: Callable[[], bool] | None = None) -> Any: ...
    def update_weights_from_disk(self, model_path: str, weight_version: Any = None, load_format: Any = None) -> dict: ...
    def pause_generation(self, mode: str = "abort") -> dict[str, Any]: ...
    def continue_generation(self) -> dict[str, Any]: ...
    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> dict[str, Any]: ...
    def flush_cache(self) -> dict[str, Any]: ...
    def health(self) -> bool: ...
    def health_generate(self) -> bool: ...
    def server_info(self) -> dict[str, Any]: ...
    def model_info(self) -> dict[str, Any]: ...
    def loads(self) -> dict[str, Any]: ...


def check_generate_keys(payload: Any, supported: set[str] | frozenset[str], engine_name: str) -> None:
    """Refuse a ``/generate`` body that is not an object, has a key outside ``supported`` (and the
    neutral ones), or sets a neutral key to a value that would change the result."""
    if not isinstance(payload, dict):
        raise RequestError(f"request body must be a JSON object, got {type(payload).__name__}")
    unknown = sorted(set(payload) - set(supported) - NEUTRAL_REQUEST_KEYS - set(ROUTER_NEUTRAL_VALUES))
    if unknown:
        raise RequestError(f"unknown /generate keys {unknown}; remove them ({engine_name} does not implement them)")
    for key in NEUTRAL_REQUEST_KEYS:
        if payload.get(key):
            raise RequestError(f"/generate field {key!r} is not supported by {engine_name}")
    for key, neutral in ROUTER_NEUTRAL_VALUES.items():
        if key in payload and not any(payload[key] is v for v in neutral):
            allowed = " or ".join(json.dumps(v) for v in neutral)
            raise RequestError(
                f"/generate field {key!r}={json.dumps(payload[key])[:80]} would change the result and is not "
                f"supported by {engine_name}; send {allowed} or leave it out"
            )


def _routes(engine: SGLangEngine) -> dict[tuple[str, str], Callable[..., tuple[int, Any]]]:
    name = engine.engine_name

    def ok(value: Any) -> tuple[int, Any]:
        return 200, value

    def probe(check: str, failure: str) -> Callable[[dict], tuple[int, Any]]:
        return lambda body: ((200, {"status": "ok"}) if getattr(engine, check)()
                             else (503, {"error": f"{name} {failure}"}))

    def update_from_disk(body: dict) -> tuple[int, Any]:
        if "model_path" not in body:
            raise RequestError("update_weights_from_disk needs 'model_path'")
        extra = {k: body[k] for k in ("weight_version", "load_format") if k in body}
        return ok(engine.update_weights_from_disk(body["model_path"], **extra))

    def pause(body: dict) -> tuple[int, Any]:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise RequestError(f"mode must be 'abort', 'in_place' or 'retract', got {mode!r}")
        return ok(engine.pause_generation(mode))

    def abort(body: dict) -> tuple[int, Any]:
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if rid is not None and not isinstance(rid, str):
            raise RequestError("rid must be a string")
        if not isinstance(abort_all, bool):
            raise RequestError("abort_all must be true or false")
        return ok(engine.abort_request(rid=rid, abort_all=abort_all))

    def no_op(body: dict) -> tuple[int, Any]:
        return ok({"success": True, "message": f"no-op on {name}"})

    def release(body: dict) -> tuple[int, Any]:
        fn = getattr(engine, "release_memory_occupation", None)
        return no_op(body) if fn is None else ok(fn())

    def resume(body: dict) -> tuple[int, Any]:
        fn = getattr(engine, "resume_memory_occupation", None)
        if fn is None:
            return no_op(body)
        tags = body.get("tags")
        if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
            raise RequestError("tags must be a list of strings")
        return ok(fn(tags))

    def unsupported(body: dict) -> tuple[int, Any]:
        return 501, {"success": False, "error": f"{name} supports disk weight sync only (--update-weight-transport disk)"}

    def generate(body: dict, is_disconnected: Callable[[], bool] | None = None) -> tuple[int, Any]:
        return ok(engine.generate(body, is_disconnected=is_disconnected))

    generate.needs_client = True  # type: ignore[attr-defined]  # _dispatch passes the disconnect probe

    routes: dict[tuple[str, str], Callable[..., tuple[int, Any]]] = {
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
        ("POST", "/release_memory_occupation"): release,
        ("POST", "/resume_memory_occupation"): resume,
        ("POST", "/post_process_weights"): no_op,
    }
    for method in ("GET", "POST"):
        routes[(method, "/health")] = probe("health", "is not healthy")
        routes[(method, "/health_generate")] = probe("health_generate", "cannot generate")
        routes[(method, "/flush_cache")] = lambda body: ok(engine.flush_cache())
    for path in _UNSUPPORTED_SYNC:
        routes[("POST", path)] = unsupported
    tokenize = getattr(engine, "tokenize", None)
    if tokenize is not None:
        # SGLang 0.5.15 serves one handler under both names (sglang/srt/entrypoints/http_server.py:1648-1663)
        routes[("POST", "/tokenize")] = routes[("POST", "/v1/tokenize")] = lambda body: ok(tokenize(body))
    return routes


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "slime-ascend"
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

    def _dispatch(self) -> None:
        method = self.command
        path = urlsplit(self.path).path.rstrip("/") or "/"
        try:
            try:
                body = self._read_body()
            except RequestError:
                self.close_connection = True  # the body may be unread; do not reuse the connection
                raise
            if path in WORK_PATHS and self.server.control_only(self.request):  # a BoundedThreadingHTTPServer
                self.close_connection = True
                self._send(503, {"error": self.server.busy_message(), "success": False})
                return
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

    # the stdlib calls do_<METHOD>; each goes through the route table (405 where a path has no such method)
    do_GET = do_POST = do_PUT = do_DELETE = _dispatch


# connections past --max-connections that serve every endpoint but the ones below (control calls)
CONTROL_CONNECTIONS = 16
WORK_PATHS = frozenset({"/generate"})


class BoundedThreadingHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once plus ``CONTROL_CONNECTIONS`` for
    everything but ``WORK_PATHS`` (503 and close beyond), listening with a ``backlog`` deep accept queue."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, backlog: int, max_connections: int) -> None:
        self.request_queue_size = backlog  # socketserver passes it to listen(); the stdlib default is 5
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._control_slots = threading.BoundedSemaphore(CONTROL_CONNECTIONS)
        self._control_only: dict[int, threading.BoundedSemaphore] = {}  # id(socket) -> the slot it holds
        super().__init__(address, handler)

    def busy_message(self) -> str:
        return f"server busy: {self.max_connections} connections open (--max-connections)"

    def control_only(self, request: Any) -> bool:
        """Whether ``request``'s connection holds a control slot (it may not start work)."""
        return id(request) in self._control_only

    def process_request(self, request: Any, client_address: Any) -> None:
        if self._slots.acquire(blocking=False):
            slot = self._slots
        elif self._control_slots.acquire(blocking=False):
            slot = self._control_slots
            self._control_only[id(request)] = slot
        else:
            body = json.dumps({"success": False, "error": self.busy_message()}).encode()
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
            self._release(request, slot)
            raise

    def _release(self, request: Any, slot: threading.BoundedSemaphore) -> None:
        self._control_only.pop(id(request), None)
        slot.release()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        slot = self._control_only.get(id(request), self._slots)
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request, slot)


def make_server(
    engine: SGLangEngine,
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
    check_positive_ints(backlog=backlog, max_connections=max_connections, max_body_bytes=max_body_bytes)
    handler = type(
        "SGLangSurfaceHandler",
        (_Handler,),
        {"routes": _routes(engine), "timeout": timeout, "max_body_bytes": max_body_bytes,
         "server_version": f"slime-ascend ({engine.engine_name})"},
    )
    return BoundedThreadingHTTPServer((host, port), handler, backlog=backlog, max_connections=max_connections)


def serve_until_interrupted(server: ThreadingHTTPServer) -> None:
    """Serve until Ctrl-C, then close the listening socket."""
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def build_parser() -> argparse.ArgumentParser:
    from . import reference as _engine_mod  # the limits only: no torch before --help

    from ..command import ArgumentParser

    parser = ArgumentParser(
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
    limits.add_argument("--max-top-logprobs", type=_positive_int, default=_engine_mod.DEFAULT_MAX_TOP_LOGPROBS,
                        help="most top-k log-prob entries in one answer: top_logprobs_num x scored and new "
                        "positions, over a batch (default %(default)s)")
    limits.add_argument("--timeout", type=_positive_float, default=DEFAULT_TIMEOUT_S,
                        help="seconds a connection may sit idle or stalled mid-request (default %(default)s)")
    limits.add_argument("--backlog", type=_positive_int, default=DEFAULT_BACKLOG,
                        help="listen backlog: connections queued before accept (default %(default)s)")
    limits.add_argument("--max-connections", type=_positive_int, default=DEFAULT_MAX_CONNECTIONS,
                        help="connections served at once; more get 503 (default %(default)s)")
    limits.add_argument("--max-body-bytes", type=_positive_int, default=MAX_BODY_BYTES,
                        help="largest request body in bytes (default %(default)s)")
    return parser


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


_positive_int = _positive(int, "integer")
_positive_float = _positive(float, "number of seconds")


def serve_reference(argv: list[str] | None = None) -> int:
    """CLI entry: ``slime-ascend serve-reference --model DIR --host 127.0.0.1 --port PORT``: load the
    reference engine and serve it until interrupted."""
    args = build_parser().parse_args(argv)  # before torch is imported: --help answers at once
    from .reference.engine import ReferenceEngine

    if not logging.getLogger().handlers:  # the engine's own events (weight updates) on stderr
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = ReferenceEngine(model_path=args.model, dtype=args.dtype, seed=args.seed,
                             max_batch_size=args.max_batch_size, max_prompt_tokens=args.max_prompt_tokens,
                             max_new_tokens=args.max_new_tokens, max_top_logprobs=args.max_top_logprobs)
    server = make_server(engine, host=args.host, port=args.port, timeout=args.timeout, backlog=args.backlog,
                         max_connections=args.max_connections, max_body_bytes=args.max_body_bytes)
    bound_host, bound_port = server.server_address[:2]
    print(f"reference engine serving {engine.server_info()['model_path']} at http://{bound_host}:{bound_port}", flush=True)
    serve_until_interrupted(server)
    return 0


if __name__ == "__main__":  # pragma: no cover
    # run the imported module's copy: the engine raises that module's RequestError, not __main__'s
    from slime_ascend.rollout.http_api import serve_reference as _serve_reference

    raise SystemExit(_serve_reference())

"""SGLang-compatible HTTP surface for :class:`ReferenceEngine` (stdlib ``http.server`` only).

Endpoints (the ones slime's rollout, external-engine discovery and weight sync call):

* ``POST /generate``; ``GET|POST /health``, ``/health_generate``
* ``GET /server_info``, ``/get_server_info``, ``/get_model_info``, ``/get_weight_version``, ``/v1/loads``
* ``POST /update_weights_from_disk``, ``/pause_generation``, ``/continue_generation``, ``/abort_request``
* ``GET|POST /flush_cache``; no-op ``POST /release_memory_occupation``, ``/resume_memory_occupation``,
  ``/post_process_weights``
* ``POST /update_weights_from_distributed``, ``/update_weights_from_tensor``, ``/init_weights_update_group``:
  501 (disk sync only).

Client errors answer 4xx with ``{"error": message}``; an unexpected failure answers 500 and the
server keeps running. Binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from slime_ascend.rollout.reference_engine import ReferenceEngine, RequestError

__all__ = ["main", "make_server", "serve_reference"]

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 1024 * 1024

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

    routes: dict[tuple[str, str], Callable[[dict[str, Any]], tuple[int, Any]]] = {
        ("POST", "/generate"): lambda body: ok(engine.generate(body)),
        ("POST", "/update_weights_from_disk"): update_from_disk,
        ("POST", "/pause_generation"): pause,
        ("POST", "/continue_generation"): lambda body: ok(engine.continue_generation()),
        ("POST", "/abort_request"): abort,
        ("GET", "/get_weight_version"): lambda body: ok({"weight_version": engine.weight_version}),
        ("GET", "/get_model_info"): lambda body: ok(engine.model_info()),
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
        self.wfile.write(data)

    def _read_body(self) -> dict[str, Any]:
        length_header = self.headers.get("Content-Length")
        try:
            length = int(length_header) if length_header is not None else 0
        except ValueError as exc:
            raise RequestError("invalid Content-Length header") from exc
        if length < 0:
            raise RequestError("invalid Content-Length header")
        if length > MAX_BODY_BYTES:
            raise RequestError(f"request body larger than {MAX_BODY_BYTES} bytes", status=413)
        raw = self.rfile.read(length) if length else b""
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"request body is not valid JSON: {exc}") from exc
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


def make_server(engine: ReferenceEngine, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A bound (not yet serving) threaded HTTP server for ``engine``; ``port=0`` picks a free port."""
    handler = type("ReferenceEngineHandler", (_Handler,), {"routes": _routes(engine)})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def main(
    model: str | None = None, host: str = "127.0.0.1", port: int = 30000, seed: int = 0, dtype: str = "float32"
) -> None:
    """Load the engine and serve it until interrupted."""
    engine = ReferenceEngine(model_path=model, dtype=dtype, seed=seed)
    server = make_server(engine, host=host, port=port)
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
    return parser


def serve_reference(argv: list[str] | None = None) -> int:
    """CLI entry: ``slime-ascend serve-reference --model DIR --host 127.0.0.1 --port PORT``."""
    args = build_parser().parse_args(argv)
    main(model=args.model, host=args.host, port=args.port, seed=args.seed, dtype=args.dtype)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(serve_reference())

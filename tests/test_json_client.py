"""json_client: the one JSON-over-HTTP client (blocking and async) against a local server that fails on cue."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slime_ascend import json_client
from slime_ascend.json_client import JSONRequestError, arequest_json, request_json


@pytest.fixture
def server():
    """Answers the queued statuses in order (then 200); echoes the JSON body it got."""
    state = {"statuses": [], "bodies": []}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _answer(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else None
            state["bodies"].append((self.command, body))
            status = state["statuses"].pop(0) if state["statuses"] else 200
            data = json.dumps({"got": body} if status == 200 else {"error": f"status {status}"}).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    httpd.shutdown()
    httpd.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(kind, url, payload=None, **kw):
    if kind == "sync":
        return request_json(url, payload, **kw)

    async def run():
        try:
            return await arequest_json(url, payload, **kw)
        finally:
            await json_client.aclose()

    return asyncio.run(run())


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_post_get_and_5xx_retried(server, kind):
    url, state = server
    assert call(kind, url + "/x", {"a": 1}) == {"got": {"a": 1}}
    assert call(kind, url + "/x") == {"got": None} and state["bodies"][-1][0] == "GET"
    state["statuses"][:] = [503, 500]
    retried = []
    assert call(kind, url + "/x", {"b": 2}, retries=2, backoff_s=0.01, on_retry=lambda: retried.append(1)) == {
        "got": {"b": 2}}
    assert len(retried) == 2


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_4xx_is_not_retried_and_failures_name_url_attempts_and_answer(server, kind):
    url, state = server
    state["statuses"][:] = [400, 400]
    with pytest.raises(JSONRequestError, match=r"failed after 1 attempt\(s\): HTTP 400: .*status 400") as err:
        call(kind, url + "/x", {}, retries=3, backoff_s=0.01)
    assert err.value.status == 400 and len(state["bodies"]) == 1
    dead = f"http://127.0.0.1:{closed_port()}/x"
    with pytest.raises(JSONRequestError, match="failed after 3 attempt") as err:
        call(kind, dead, {}, retries=2, backoff_s=0.01, timeout_s=5)
    assert err.value.status is None and dead in str(err.value)

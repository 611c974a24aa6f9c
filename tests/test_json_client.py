"""json_client: the one JSON-over-HTTP client (blocking and async) against a local server that fails on cue."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import trickling_server

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


@pytest.fixture
def trickle():
    """Answers every request with a valid JSON body, one byte a second (headers too): each read succeeds well
    inside any per-read timeout, so only a whole-request deadline stops the client."""
    with trickling_server(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"a": true}') as url:
        yield url


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_deadline_bounds_a_trickling_answer(trickle, kind):
    import time

    t0 = time.monotonic()
    with pytest.raises(JSONRequestError, match=r"no complete answer within 1\.5 s \(the request's deadline\)") as err:
        call(kind, trickle + "/x", {}, timeout_s=5, deadline_s=1.5, retries=3, backoff_s=0.01)
    elapsed = time.monotonic() - t0
    assert 1.4 < elapsed < 3.0, elapsed  # the answer would take ~80 s; each byte comes within the 5 s timeout
    assert err.value.status is None and err.value.attempts == 1  # a passed deadline is not retried


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_deadline_leaves_a_prompt_answer_alone_and_caps_the_retries(server, kind):
    import time

    url, state = server
    assert call(kind, url + "/x", {"a": 1}, deadline_s=5) == {"got": {"a": 1}}
    state["statuses"][:] = [503] * 10
    t0 = time.monotonic()
    with pytest.raises(JSONRequestError, match=r"HTTP 503: .*the next attempt would start past the 3 s deadline") as err:
        call(kind, url + "/x", {}, retries=9, backoff_s=0.5, deadline_s=3)
    # waits 0.5 + 1 s, then the 2 s wait would end past the deadline (1.5 s left, less the three requests' own time,
    # which a loaded 2-core CI host stretched past the 0.4 s a 1 s deadline left): three attempts, not ten
    assert err.value.attempts == 3 and time.monotonic() - t0 < 3.0

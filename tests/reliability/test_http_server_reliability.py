"""Replayed hostile clients of SGLang's HTTP surface (issue 29), on the server both engines use
(:mod:`slime_ascend.rollout.http_server`), with a stub engine: loopback only, deadlines of about a second.

- a client trickling its headers or body one byte at a time, each read well inside the per-read ``timeout``,
  is answered 408 and closed at the whole-request deadline (before: kept for as long as it trickled);
- 528 trickling connections (``--max-connections`` + the control reserve) no longer make ``/health`` and
  ``/generate`` answer 503: connections still receiving a request are bounded apart from requests being served,
  and the longest waiting is closed for a newcomer;
- headers are bounded in all (5.8 MB were accepted: 100 lines of 64 KB) and answered 431;
- a ``Content-Length`` above ``--max-body-bytes`` is refused before a byte of the body is read, and the default
  limit refuses the 45 MB body that was read and parsed before the engine's batch limit applied.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter

import pytest

from slime_ascend.rollout.http_server import CONTROL_CONNECTIONS, make_server
from slime_ascend.rollout.sglang_protocol import RequestError


class StubEngine:
    """SGLang's engine surface with no model: ``/generate`` answers one token, or waits on ``hold`` (a slot held);
    ``/flush_cache`` waits on ``hold`` too (a control call held). Counts the bodies it was given."""

    engine_name = "stub engine"
    weight_version = "0"

    def __init__(self, hold: threading.Event | None = None) -> None:
        self.hold, self.generated = hold, []

    def _wait(self) -> None:
        if self.hold is not None:
            assert self.hold.wait(30)

    def generate(self, payload, is_disconnected=None):
        self.generated.append(payload)
        if len(payload.get("input_ids", [])) > 64:
            raise RequestError("batch of more than 64 prompts (--max-batch-size)", status=413)
        self._wait()
        return {"text": "", "output_ids": [7], "meta_info": {}}

    def flush_cache(self):
        self._wait()
        return {"success": True}

    def health(self):
        return True

    health_generate = health

    def server_info(self):
        return {}

    model_info = loads = server_info

    def pause_generation(self, mode="abort"):
        return {}

    def continue_generation(self):
        return {}

    def abort_request(self, rid=None, abort_all=False):
        return {}

    def update_weights_from_disk(self, model_path, weight_version=None, load_format=None):
        return {}


@pytest.fixture
def serve():
    """``serve(engine=None, **limits) -> (host, port)``: a server of ``make_server``, stopped afterwards."""
    servers = []

    def start(engine=None, **limits):
        server = make_server(engine or StubEngine(), **limits)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[:2]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


HEALTH = b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n"
ONE_PROMPT = b'{"input_ids": [1, 2]}'
GENERATE = (b"POST /generate HTTP/1.1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(ONE_PROMPT)
            + ONE_PROMPT)


def _answer(sock: socket.socket) -> tuple[int | None, dict]:
    """Read to EOF: (status, JSON body), (None, {}) when the server closed without a word."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    if not data:
        return None, {}
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body or b"{}")


def ask(addr, raw: bytes, timeout: float = 10) -> tuple[int | None, dict]:
    with socket.create_connection(addr, timeout=timeout) as sock:
        try:
            sock.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):  # refused early: the answer may still be there to read
            pass
        return _answer(sock)


# ---------------------------------------------------------------- trickling: a whole-request deadline


TRICKLED = {
    "headers": (b"", b"POST /generate HTTP/1.1\r\nX-Pad: " + b"a" * 100),
    "body": (b"POST /generate HTTP/1.1\r\nContent-Length: 200\r\n\r\n", b'{"input_ids": [' + b"1," * 100),
}


@pytest.mark.parametrize("part", list(TRICKLED))
def test_a_trickling_client_is_closed_at_the_request_deadline(serve, part):
    """One byte every 0.2 s with a per-read timeout of 1 s: every read succeeds, so before the fix the server
    kept the connection as long as bytes came (12 s measured, the test's cap); now 408 at 1 s."""
    addr = serve(timeout=1.0, request_timeout=1.0)
    sent_whole, trickled = TRICKLED[part]
    with socket.create_connection(addr, timeout=10) as sock:
        sock.sendall(sent_whole)
        start = time.monotonic()
        for i in range(len(trickled)):
            sock.settimeout(0.2)
            try:
                if sock.recv(1, socket.MSG_PEEK) is not None:
                    break  # the server answered (or closed)
            except TimeoutError:
                pass
            sock.sendall(trickled[i:i + 1])
        closed_after = time.monotonic() - start
        sock.settimeout(5)
        status, body = _answer(sock)
    assert 0.9 < closed_after < 2.5, f"closed after {closed_after:.1f} s (trickled {len(trickled) * 0.2:.0f} s)"
    assert status == 408 and "--request-timeout" in body["error"], body


def test_an_honest_slow_request_inside_the_deadline_is_served(serve):
    """The deadline is for the whole request, not a rate: 0.5 s of pauses inside a 2 s deadline is served."""
    addr = serve(timeout=1.0, request_timeout=2.0)
    with socket.create_connection(addr, timeout=10) as sock:
        for piece in (GENERATE[:20], GENERATE[20:60], GENERATE[60:]):
            sock.sendall(piece)
            time.sleep(0.25)
        assert _answer(sock)[0] == 200


# ---------------------------------------------------------------- many tricklers: waiting apart from serving


def _tricklers(addr, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        sock = socket.create_connection(addr, timeout=10)
        sock.sendall(b"POST /generate HTTP/1.1\r\nContent-Le")  # a request begun, never finished
        socks.append(sock)
    return socks


def test_528_trickling_connections_leave_health_and_generate_answering(serve):
    """The issue's case at the default limits: 528 = 512 connections + 16 control ones made every later
    client 503 for as long as the tricklers kept a byte coming; now both answer 200 at once."""
    addr = serve()
    socks = _tricklers(addr, 528)
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        assert ask(addr, HEALTH)[0] == 200
        assert ask(addr, GENERATE)[0] == 200
        assert time.monotonic() - t0 < 3
    finally:
        for sock in socks:
            sock.close()


def test_past_max_waiting_the_longest_waiting_connection_is_closed(serve):
    """20 waiting connections allowed: 30 tricklers, then 5 honest clients one after the other. Counted by hand:
    the 21st to 30th trickler close the 10 oldest; the first honest client makes 21 and closes one more; it leaves
    (Connection: close), so the next ones make 20 and close none. The 11 closed got 503 naming
    --max-waiting-connections (each had begun a request), the 19 newest stay, every honest client is served."""
    addr = serve(max_waiting_connections=20, request_timeout=60, timeout=60)
    socks = _tricklers(addr, 30)
    try:
        time.sleep(0.3)
        assert Counter(ask(addr, HEALTH if i % 2 else GENERATE)[0] for i in range(5)) == {200: 5}
        for sock in socks:
            sock.settimeout(0.1)
        results = []
        for sock in socks:
            try:
                results.append(_answer(sock))
            except TimeoutError:
                results.append("open")
        closed, still_open = results[:11], results[11:]
        assert all(r != "open" and r[0] == 503 and "--max-waiting-connections" in r[1]["error"] for r in closed), closed
        assert still_open == ["open"] * 19
    finally:
        for sock in socks:
            sock.close()


def test_requests_being_served_are_capped_with_a_control_reserve(serve):
    """``--max-connections`` still bounds the requests being served: 2 /generate held, a third is 503 naming the
    flag; control calls use the reserve of CONTROL_CONNECTIONS (16) until it too is held, then 503."""
    hold = threading.Event()
    engine = StubEngine(hold)
    addr = serve(engine, max_connections=2)
    held = []
    try:
        for _ in range(2):
            sock = socket.create_connection(addr, timeout=30)
            sock.sendall(GENERATE)
            held.append(sock)
        deadline = time.monotonic() + 10
        while len(engine.generated) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, body = ask(addr, GENERATE)
        assert status == 503 and "--max-connections" in body["error"], body
        assert ask(addr, HEALTH)[0] == 200  # a control slot
        for _ in range(CONTROL_CONNECTIONS):
            sock = socket.create_connection(addr, timeout=30)
            sock.sendall(b"POST /flush_cache HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
            held.append(sock)
        time.sleep(0.3)
        assert ask(addr, HEALTH)[0] == 503
        hold.set()
        assert Counter(_answer_first(sock) for sock in held) == {200: 2 + CONTROL_CONNECTIONS}
        assert ask(addr, GENERATE)[0] == 200  # the slots came back
    finally:
        hold.set()
        for sock in held:
            sock.close()


def _answer_first(sock: socket.socket) -> int:
    """The status of the first answer on a kept-alive connection."""
    data = b""
    while b"\r\n" not in data:
        data += sock.recv(65536)
    return int(data.split(b" ", 2)[1])


# ---------------------------------------------------------------- headers: bounded in all


def _request_with_headers(total: int) -> bytes:
    """A GET /health whose request line, headers and blank line are exactly ``total`` bytes."""
    start = b"GET /health HTTP/1.1\r\nConnection: close\r\n"
    pad = total - len(start) - len(b"X-Pad: \r\n") - len(b"\r\n")
    return start + b"X-Pad: " + b"a" * pad + b"\r\n\r\n"


def test_headers_are_bounded_in_all_with_431_naming_the_flag(serve):
    addr = serve(max_header_bytes=2000)
    assert len(_request_with_headers(2000)) == 2000
    assert ask(addr, _request_with_headers(2000))[0] == 200
    status, body = ask(addr, _request_with_headers(2001))
    assert status == 431 and "--max-header-bytes" in body["error"] and "2000" in body["error"], body
    many = b"GET /health HTTP/1.1\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 30) for i in range(60)) + b"\r\n"
    assert len(many) > 2000 and ask(addr, many)[0] == 431  # many short lines count the same


def test_the_issue_s_5_8_mb_of_headers_is_431_at_the_default_limit(serve):
    """98 lines of 59 KB (each under the stdlib's 64 KB line limit and 100-line count) were parsed whole
    (+44 MB server RSS); the default limit is 64 KiB in all, and the client reads the 431 (not a reset)."""
    addr = serve()
    raw = b"GET /health HTTP/1.1\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"a" * 59000) for i in range(98)) + b"\r\n"
    t0 = time.monotonic()
    status, body = ask(addr, raw)
    assert status == 431 and "65536" in body["error"], body
    assert time.monotonic() - t0 < 3


# ---------------------------------------------------------------- body: refused from Content-Length


def test_a_body_over_the_limit_is_413_before_it_is_read(serve):
    engine = StubEngine()
    addr = serve(engine, max_body_bytes=1000)
    with socket.create_connection(addr, timeout=5) as sock:  # headers only: the body is never sent
        sock.sendall(b"POST /generate HTTP/1.1\r\nContent-Length: 1000000000\r\n\r\n")
        status, body = _answer(sock)
    assert status == 413 and "--max-body-bytes" in body["error"] and "1000000000" in body["error"], body
    exact = b'{"input_ids": [' + b" " * (1000 - 18) + b"1]}"
    assert len(exact) == 1000
    raw = b"POST /generate HTTP/1.1\r\nConnection: close\r\nContent-Length: 1000\r\n\r\n" + exact
    assert ask(addr, raw)[0] == 200 and engine.generated == [{"input_ids": [1]}]


def test_the_issue_s_45_mb_body_is_refused_before_it_is_parsed(serve):
    """45 MB of one-prompt lists were read and parsed (18 s, +1.2 GB server RSS on the 2-core Xeon) before the
    engine's batch limit refused them; the default body limit refuses it from Content-Length, and the client,
    which sends the whole body first, still reads the 413."""
    engine = StubEngine()
    addr = serve(engine)
    body = b'{"input_ids": [' + b",".join([b"[1]"] * 11_250_000) + b"]}"
    t0 = time.monotonic()
    status, answer = ask(addr, b"POST /generate HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    assert status == 413 and "--max-body-bytes" in answer["error"], answer
    assert time.monotonic() - t0 < 5 and engine.generated == []


def test_the_default_body_limit_holds_a_full_default_prompt():
    """4x the JSON of the engine's default --max-prompt-tokens (131072) of the largest 6-digit ids, as
    ``json.dumps`` writes them (8 bytes each)."""
    from slime_ascend.rollout.torch_engine import DEFAULT_MAX_PROMPT_TOKENS

    full = len(json.dumps({"input_ids": [151935] * 131072}))
    assert DEFAULT_MAX_PROMPT_TOKENS == 131072 and full == 8 * 131072 + 15
    server = make_server(StubEngine())
    try:
        limit = server.RequestHandlerClass.max_body_bytes
        assert full < limit <= 4 * 1024 * 1024
        assert server.RequestHandlerClass.max_header_bytes == 64 * 1024
        assert 0 < server.RequestHandlerClass.request_timeout <= 60
    finally:
        server.server_close()


# ---------------------------------------------------------------- the same flags on both servers


LIMIT_FLAGS = ["--timeout", "3", "--request-timeout", "1.5", "--max-waiting-connections", "7",
               "--max-header-bytes", "2048", "--max-body-bytes", "4096", "--max-connections", "5", "--backlog", "9"]


def _limits(server) -> tuple:
    handler = server.RequestHandlerClass
    return (handler.timeout, handler.request_timeout, server.max_waiting, handler.max_header_bytes,
            handler.max_body_bytes, server.max_connections, server.request_queue_size)


def test_the_vllm_adapter_serves_with_the_same_flags(monkeypatch):
    from slime_ascend.rollout.backends import vllm_ascend

    served = []
    monkeypatch.setattr(vllm_ascend, "serve_until_interrupted",
                        lambda server: (served.append(server), server.server_close()))
    assert vllm_ascend.main(["--vllm-url", "http://127.0.0.1:9", "--model", "m", "--port", "0", *LIMIT_FLAGS]) == 0
    assert _limits(served[0]) == (3.0, 1.5, 7, 2048, 4096, 5, 9)


def test_serve_torch_takes_the_limit_flags_and_refuses_bad_ones_in_one_line(capsys):
    from slime_ascend.rollout.http_server import server_options
    from slime_ascend.rollout.torch_engine.cli import build_parser

    server = make_server(StubEngine(), **server_options(build_parser().parse_args(LIMIT_FLAGS)))
    try:
        assert _limits(server) == (3.0, 1.5, 7, 2048, 4096, 5, 9)
    finally:
        server.server_close()
    for bad in (["--request-timeout", "0"], ["--max-header-bytes", "-1"], ["--max-waiting-connections", "x"]):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(bad)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and bad[0] in err, err

"""A loopback HTTP proxy in front of one rollout engine that injects a fault at a known request.

slime (its router, its SGLangEngine actor) is given the proxy's address instead of the engine's; every request
is forwarded to the engine and its answer sent back, until the request the test names:

* ``kill_at=("/generate", k)``: at the k-th ``POST /generate`` the proxy stops forwarding (that request and any
  later one get their connection closed, unanswered), waits for the requests already forwarded to be answered
  (so exactly k - 1 of them were), then kills the engine's process group (SIGKILL), stops listening and drops
  every open connection: from then on the address refuses connections, as a dead engine's does;
* ``hold_at=("/update_weights_from_disk", k)``: the k-th such request is never forwarded nor answered (the
  connection stays open until the proxy is closed); every other request is still forwarded. The engine
  itself never sees the request.

The fault is tied to a request count, not to a time. :attr:`answered` counts the answers (HTTP 200) the proxy
delivered per path, :attr:`seen` the requests per path, so a test can tell which engine served what.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class FaultProxy:
    def __init__(self, target_url: str, engine_pid: int | None = None, *, kill_at: tuple[str, int] | None = None,
                 hold_at: tuple[str, int] | None = None):
        target = urlsplit(target_url)
        self.target = (target.hostname, target.port)
        self.engine_pid, self.kill_at, self.hold_at = engine_pid, kill_at, hold_at
        self.seen: Counter = Counter()
        self.answered: Counter = Counter()
        self.killed = threading.Event()
        self._dying = threading.Event()
        self._in_flight = 0
        self._idle = threading.Condition(threading.Lock())
        self.held = threading.Event()
        self._release = threading.Event()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._sockets: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
        self._thread.start()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}"

    @property
    def url(self) -> str:
        return "http://" + self.addr

    def close(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()
        self._drop_connections()

    def _drop_connections(self) -> None:
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _kill(self) -> None:
        with self._idle:  # the requests forwarded before the k-th are answered first (bounded)
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=120)
        if self.engine_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.engine_pid, signal.SIGKILL)
        self.killed.set()
        # stop listening (new connections are refused) and cut the open ones, from another thread: shutdown()
        # waits for serve_forever, which this handler's thread must not block
        threading.Thread(target=self.close, daemon=True).start()

    def _fault(self, method: str, path: str) -> str | None:
        """What to do with this request: None (forward), "kill" or "hold"."""
        with self._lock:
            self.seen[path] += 1
            count = self.seen[path]
        if method == "POST" and self.kill_at == (path, count):
            return "kill"
        if method == "POST" and self.hold_at == (path, count):
            return "hold"
        return None

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                with proxy._lock:
                    proxy._sockets.add(self.connection)

            def finish(self):
                with proxy._lock:
                    proxy._sockets.discard(self.connection)
                with contextlib.suppress(OSError):
                    super().finish()

            def log_message(self, *args):  # quiet
                pass

            def _forward(self, method: str):
                path = urlsplit(self.path).path
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy._idle:  # decided and counted at once: nothing is forwarded once the kill is decided
                    fault = "drop" if proxy._dying.is_set() else proxy._fault(method, path)
                    if fault == "kill":
                        proxy._dying.set()
                    elif fault is None:
                        proxy._in_flight += 1
                if fault == "drop":
                    self.close_connection = True
                    return
                if fault == "kill":
                    proxy._kill()
                    self.close_connection = True
                    return
                if fault == "hold":
                    proxy.held.set()
                    proxy._release.wait()
                    self.close_connection = True
                    return
                # in flight until its answer is written back: a kill waiting for the forwarded requests must not
                # cut the connection of one the engine answered (under load the cut came first: "Server
                # disconnected" for an answered request)
                try:
                    conn = http.client.HTTPConnection(*proxy.target, timeout=600)
                    try:
                        headers = {k: v for k, v in self.headers.items()
                                   if k.lower() not in ("host", "connection", "content-length", "transfer-encoding")}
                        conn.request(method, self.path, body=body or None, headers=headers)
                        answer = conn.getresponse()
                        data = answer.read()
                    except OSError:  # the engine is gone: so is this connection
                        self.close_connection = True
                        return
                    finally:
                        conn.close()
                    self.send_response(answer.status)
                    for key, value in answer.getheaders():
                        if key.lower() not in ("connection", "content-length", "transfer-encoding", "date", "server"):
                            self.send_header(key, value)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    self.wfile.flush()
                    if answer.status == 200:
                        with proxy._lock:
                            proxy.answered[path] += 1
                finally:
                    with proxy._idle:
                        proxy._in_flight -= 1
                        proxy._idle.notify_all()

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

            def do_DELETE(self):
                self._forward("DELETE")

        return Handler

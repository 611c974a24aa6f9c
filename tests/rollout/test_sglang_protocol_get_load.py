"""``GET /get_load``: SGLang's legacy load endpoint, which sglang-router's load monitor polls for its ``power_of_two``
policy, on the torch engine: the fields SGLang 0.5.15 projects from ``/v1/loads`` (read from its source), and the
router (slime's, ``sglang_router`` 0.3.2) sending requests away from an engine whose KV reservations are larger."""

from __future__ import annotations

import ast
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import need

from slime_ascend.rollout.sglang_protocol import legacy_load

HTTP = httpx.Client(trust_env=False)


def _sglang_get_load_keys() -> set[str]:
    """The keys of the dict SGLang's own ``get_load`` handler returns (its source, parsed; importing the module needs
    SGLang's audio packages)."""
    need("sglang")
    from slime_ascend._import_hooks import module_file

    tree = ast.parse(module_file("sglang.srt.entrypoints.http_server").read_text())
    (handler,) = [node for node in ast.walk(tree) if isinstance(node, ast.AsyncFunctionDef) and node.name == "get_load"]
    (comp,) = [node for node in ast.walk(handler) if isinstance(node, ast.ListComp)]
    return {key.value for key in comp.elt.keys}


def test_the_fields_are_sglangs():
    ours = legacy_load([{"dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 1, "num_used_tokens": 40,
                         "num_total_tokens": 55}])
    assert set(ours[0]) == _sglang_get_load_keys()
    assert {k: v for k, v in ours[0].items() if k != "ts_tic"} == {
        "dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 55, "num_pending_tokens": 15}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, seconds: float, what) -> None:
    """Until ``predicate()``; fails after ``seconds`` with ``what`` (a string, or a callable giving it then)."""
    end = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < end, what() if callable(what) else what
        time.sleep(0.1)


@pytest.mark.slow
def test_sglang_routers_power_of_two_sends_requests_to_the_engine_with_fewer_kv_tokens(tmp_path):
    """Two torch engines behind sglang-router ``--policy power_of_two``: one holds a request reserving 2,010 KV
    tokens (its decode held at the first step), so each of the next 8 requests through the router goes to the other
    (under an even choice, all 8 there would be a 1-in-256 event), once the router's load monitor has polled both
    (every 30 s, fixed: about 30 s of this test's wall time, little of its CPU)."""
    need("sglang_router")
    from slime_ascend.rollout.torch_engine.engine import TorchEngine

    busy, idle = TorchEngine(), TorchEngine()
    release = threading.Event()
    polls = {"busy": 0, "idle": 0}
    served = {"busy": 0, "idle": 0}
    busy_forward = busy._forward

    def held(*a, **k):  # the long request decodes one step, then waits for the test
        release.wait(120)
        return busy_forward(*a, **k)

    for name, engine in (("busy", busy), ("idle", idle)):
        get_load, generate = engine.get_load, engine.generate

        def counted_load(_name=name, _get=get_load):
            polls[_name] += 1
            return _get()

        def counted_generate(body, *a, _name=name, _gen=generate, **k):
            served[_name] += 1
            return _gen(body, *a, **k)

        engine.get_load, engine.generate = counted_load, counted_generate
    with busy.start_in_thread() as busy_url, idle.start_in_thread() as idle_url:
        busy._forward = held
        long = threading.Thread(target=lambda: HTTP.post(busy_url + "/generate", timeout=180, json={
            "input_ids": list(range(3, 13)), "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}))
        long.start()  # before the router starts: its monitor polls every 30 s (fixed in sglang-router 0.3.2)
        _wait(lambda: busy.loads()["loads"][0]["num_used_tokens"] == 2010, 30, "the long request did not start")
        served["busy"] = 0  # the long request itself came straight to the engine
        port = _free_port()
        router = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                   "--port", str(port), "--policy", "power_of_two", "--worker-urls", busy_url,
                                   idle_url], stdout=open(tmp_path / "router.log", "w"), stderr=subprocess.STDOUT)
        try:
            _wait(lambda: polls["busy"] and polls["idle"], 90,
                  lambda: f"the router's load monitor did not poll /get_load: {polls}, "
                          + (tmp_path / "router.log").read_text()[-2000:])
            time.sleep(1.0)  # the router stores both answers once it has them
            base = f"http://127.0.0.1:{port}"
            for i in range(8):
                answer = HTTP.post(base + "/generate", timeout=60, json={
                    "input_ids": [3 + i, 4, 5], "sampling_params": {"max_new_tokens": 2}})
                assert answer.status_code == 200, answer.text
            assert served == {"busy": 0, "idle": 8}, (served, polls)
        finally:
            release.set()
            router.terminate()
            router.wait(30)
            long.join(180)

"""vllm-ascend adapter end to end over loopback HTTP: slime's side -> adapter -> vLLM's answers.

vLLM's side is either vLLM 0.33.0's own server code around a toy model (``vllm_toy_server.build_app``:
vLLM's FastAPI routers, ``CompletionRequest`` validation, ``OpenAIServingCompletion`` answer building;
runs where vLLM imports) or, everywhere, the exchanges recorded from it
(``data/vllm_0.33.0.json``, replayed byte for byte: a request the adapter sends that vLLM did not see
fails the test). Expected SGLang answers are computed here from the toy model and SGLang's rules.
Not tested: a vLLM / vllm-ascend engine running a real model (neither runs on this CPU host)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import vllm_toy_server as toy

from slime_ascend.rollout.backends import vllm_ascend as va
from slime_ascend.rollout.http_server import make_server

FIXTURE = Path(__file__).parent / "data" / "vllm_0.33.0.json"
HAS_VLLM = all(importlib.util.find_spec(m) is not None for m in ("vllm", "fastapi", "uvicorn"))


class Replay:
    """Answers each request with the recorded vLLM answer to the same method, path, query and body
    (in recorded order; ``reuse``: the first match every time). Unmatched: FastAPI's 404, noted in ``misses``."""

    def __init__(self, exchanges: list[dict[str, Any]], reuse: bool = False, delay: float = 0.0):
        self.exchanges, self.reuse, self.delay = list(exchanges), reuse, delay
        self.used: set[int] = set()
        self.misses: list[tuple] = []
        self.seen: list[tuple[str, str, Any]] = []
        self.lock = threading.Lock()

    def answer(self, method: str, target: str, body: Any) -> tuple[int, Any]:
        parts = urlsplit(target)
        key = (method, parts.path, parts.query, body)
        with self.lock:
            self.seen.append((method, target, body))
            for i, ex in enumerate(self.exchanges):
                if (ex["method"], ex["path"], ex["query"], ex["request"]) == key and (self.reuse or i not in self.used):
                    self.used.add(i)
                    return ex["status"], ex["response"]
            self.misses.append(key)
        return 404, {"detail": "Not Found"}

    def handler(self):
        replay = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _serve(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                if self.path.startswith("/v1/completions") and replay.delay:
                    time.sleep(replay.delay)
                status, body = replay.answer(self.command, self.path, json.loads(raw) if raw.strip() else None)
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _serve

        return H


def recorded() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


def _serve(server) -> None:
    threading.Thread(target=server.serve_forever, daemon=True).start()


@contextlib.contextmanager
def adapter_over(upstream_port: int):
    adapter = va.VLLMAdapter(f"http://127.0.0.1:{upstream_port}", toy.MODEL, tp_size=2)
    front = make_server(adapter)
    _serve(front)
    try:
        yield f"http://127.0.0.1:{front.server_address[1]}", adapter
    finally:
        front.shutdown()
        front.server_close()


@contextlib.contextmanager
def replayed(reuse: bool = False, delay: float = 0.0, exchanges: list | None = None):
    replay = Replay(recorded()["exchanges"] if exchanges is None else exchanges, reuse=reuse, delay=delay)
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), replay.handler())
    upstream.daemon_threads = True
    _serve(upstream)
    try:
        with adapter_over(upstream.server_address[1]) as (url, adapter):
            yield url, replay, adapter
    finally:
        upstream.shutdown()
        upstream.server_close()


def post(url, body, timeout=30):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=timeout).read())


def get(url, timeout=10):
    return json.loads(urllib.request.urlopen(url, timeout=timeout).read())


# --------------------------------------------------------------------------- expected SGLang answers
def top_k(lps: list[float], k: int) -> list[list[Any]]:
    """SGLang's top-k entries of one distribution: ``[logprob, id, None]``, largest first."""
    return [[lps[v], v, None] for v in sorted(range(len(lps)), key=lambda v: -lps[v])[:k]]


def expected_generate(payload: dict[str, Any], version: str) -> dict[str, Any]:
    """What SGLang answers ``payload`` with, for the toy model, written from SGLang's rules
    (sglang 0.5.23 ``logprob_result_processor``: ``[None] + ...`` input entries, ``torch.topk`` order)."""
    ids, sp = payload["input_ids"], payload.get("sampling_params", {})
    max_new, temperature = sp.get("max_new_tokens", 128), sp.get("temperature", 1.0)
    out, finish = [], {"type": "length", "length": max_new}
    for _ in range(max_new):
        out.append(toy.toy_next((ids + out)[-1]))
        if out[-1] in sp.get("stop_token_ids", []):
            finish = {"type": "stop", "matched": out[-1]}
            break
    meta: dict[str, Any] = {"finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": len(out),
                            "cached_tokens": 0, "weight_version": version}
    if payload.get("return_logprob"):
        start, k = payload.get("logprob_start_len", -1), payload.get("top_logprobs_num", 0)
        lasts = [(ids + out)[len(ids) - 1 + i] for i in range(len(out))]
        meta["output_token_logprobs"] = [[toy.toy_logprobs(last, temperature)[t], t, None]
                                         for last, t in zip(lasts, out)]
        meta["input_token_logprobs"] = [] if start < 0 else [[None, ids[start], None]] + [
            [toy.toy_logprobs(ids[p - 1])[ids[p]], ids[p], None] for p in range(start + 1, len(ids))]
        if k:
            meta["output_top_logprobs"] = [top_k(toy.toy_logprobs(last, temperature), k) for last in lasts]
            meta["input_top_logprobs"] = [] if start < 0 else [None] + [
                top_k(toy.toy_logprobs(ids[p - 1]), k) for p in range(start + 1, len(ids))]
    return {"output_ids": out, "meta_info": meta}


def close(got: Any, want: Any) -> bool:
    """Equal, floats within 1e-9 (nested lists of SGLang log-prob entries)."""
    if isinstance(want, float):
        return isinstance(got, float) and abs(got - want) <= 1e-9
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(close(g, w) for g, w in zip(got, want))
    return got == want


def check_scenario(answers: list[tuple[int, Any]]) -> None:
    """The adapter's answers to ``toy.SCENARIO`` against SGLang's, hand-derived here."""
    version = "default"
    by_path = list(zip(toy.SCENARIO, answers, strict=True))
    for (method, path, body), (status, answer) in by_path[:-1]:
        assert status == 200, (path, body, answer)
        if path == "/generate":
            want = expected_generate(body, version)
            assert answer["output_ids"] == want["output_ids"], body
            meta = answer["meta_info"]
            for key, value in want["meta_info"].items():
                assert close(meta[key], value), (key, body, meta[key], value)
            assert not set(meta) - set(want["meta_info"]) - {"id"}, body  # no log-prob fields nobody asked for
            if body.get("top_logprobs_num"):  # each top-k row: k entries, largest first
                for row in meta["input_top_logprobs"][1:] + meta.get("output_top_logprobs", []):
                    assert len(row) == body["top_logprobs_num"] and row == sorted(row, key=lambda e: -e[0])
        elif path == "/update_weights_from_disk":
            version = body.get("weight_version") or str(int(version) + 1)
            assert answer == {"success": True, "message": f"reloaded {body['model_path']}", "weight_version": version}
        elif path == "/get_weight_version":
            assert answer == {"weight_version": version}
        else:
            assert answer.get("success", True) is True or answer == {"status": "ok"}, (path, answer)
    status, answer = answers[-1]  # vLLM's own validation refuses top_logprobs_num 50 > --max-logprobs 20
    assert status == 400 and "greater than max allowed: 20" in answer["error"], answer


def test_opd_scoring_payload_has_prompt_tokens_outside_the_top_k():
    """The scoring case exercises vLLM's (k+1)-entry rows: some prompt tokens are not in their top-3."""
    ids = toy.SCENARIO[2][2]["input_ids"]
    outside = [p for p in range(1, len(ids)) if ids[p] not in [e[1] for e in top_k(toy.toy_logprobs(ids[p - 1]), 3)]]
    inside = [p for p in range(1, len(ids)) if p not in outside]
    assert outside and inside


def test_scenario_against_recorded_vllm_answers():
    data = recorded()
    assert data["vllm_version"] == "0.33.0"
    with replayed() as (url, replay, _):
        answers = toy.run_scenario(url)
        assert replay.misses == []  # every request the adapter sent is one vLLM 0.33.0 saw and answered
        assert replay.used == set(range(len(data["exchanges"])))
    check_scenario(answers)


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM (with fastapi, uvicorn) not importable: the recorded answers test runs")
def test_scenario_against_vllm_server_code():
    exchanges: list[dict[str, Any]] = []
    server, thread, port = toy.serve_app(toy.build_app(exchanges))
    try:
        with adapter_over(port) as (url, _):
            check_scenario(toy.run_scenario(url))
    finally:
        server.should_exit = True
        thread.join(10)
    assert exchanges == recorded()["exchanges"]  # the recording is what this vLLM answers today


def test_opd_teacher_scoring_through_the_adapter():
    """slime_ascend's OPD asks the adapter exactly as it asks SGLang, and reads teacher log-probs and top-k."""
    from types import SimpleNamespace

    from slime_ascend.algorithms.opd import topk_payload_from_sglang, unpack_topk_payload
    from slime_ascend.opd.scoring import build_score_payload, response_teacher_log_probs

    ids = [1, 7, 2, 9, 0, 5]
    payload = build_score_payload(SimpleNamespace(rollout_temperature=1.0),
                                  SimpleNamespace(tokens=ids, multimodal_inputs=None), top_k=3)
    assert payload == toy.SCENARIO[2][2]  # the recorded scoring request is OPD's own
    with replayed(reuse=True) as (url, replay, _):
        scored = post(f"{url}/generate", payload)
        assert replay.misses == []
    response_length = 4  # the last 4 tokens are the response
    want = [toy.toy_logprobs(ids[p - 1])[ids[p]] for p in range(2, 6)]
    assert response_teacher_log_probs(scored, response_length) == pytest.approx(want, abs=1e-6)
    top_ids, top_lps = unpack_topk_payload(topk_payload_from_sglang(scored["meta_info"]["input_top_logprobs"],
                                                                    response_length, 3))
    for row, p in enumerate(range(2, 6)):
        lps = toy.toy_logprobs(ids[p - 1])
        order = sorted(range(toy.VOCAB), key=lambda v: -lps[v])[:3]
        assert top_ids[row].tolist() == order
        assert top_lps[row].tolist() == pytest.approx([lps[v] for v in order], abs=1e-6)


def test_scoring_request_is_vllms_prompt_only_echo():
    """OPD's max_new_tokens=0 scoring: echo + max_tokens 0 + prompt_logprobs=k, no sample logprobs."""
    body = va.to_vllm_request("m", [1, 2, 3], {"max_new_tokens": 0, "temperature": 1.0}, return_logprob=True,
                              logprob_start_len=0, top_logprobs_num=4)
    assert body["echo"] is True and body["max_tokens"] == 0 and body["prompt_logprobs"] == 4 and "logprobs" not in body
    gen = va.to_vllm_request("m", [1], {"max_new_tokens": 2}, return_logprob=True, top_logprobs_num=3)
    assert gen["echo"] is False and gen["logprobs"] == 3 and "prompt_logprobs" not in gen
    assert va.to_vllm_request("m", [1], {})["max_tokens"] == 128  # SGLang's default, not vLLM's 16
    with pytest.raises(va.RequestError, match="logprob_start_len=3 must be below"):
        va.to_vllm_request("m", [1, 2, 3], {}, return_logprob=True, logprob_start_len=3)


def test_request_mapping():
    body = va.to_vllm_request("m", [5, 6], {"max_new_tokens": 4, "temperature": 0.7, "top_k": -1, "stop": None,
                                            "no_stop_trim": True, "custom_params": {"x": 1}, "sampling_seed": 3})
    assert body == {"model": "m", "prompt": [5, 6], "logprobs": 0, "return_token_ids": True,
                    "return_tokens_as_token_ids": True, "return_weight_versions": True, "echo": False,
                    "stream": False, "n": 1, "max_tokens": 4, "temperature": 0.7, "top_k": -1,
                    "include_stop_str_in_output": True, "seed": 3}
    with pytest.raises(va.RequestError, match="regex"):
        va.to_vllm_request("m", [1], {"regex": "a+"})
    with pytest.raises(va.RequestError, match="input_ids"):
        va.to_vllm_request("m", [], {})
    with pytest.raises(va.RequestError, match="n=2"):
        va.to_vllm_request("m", [1], {"n": 2})


def test_response_checks_lengths_and_token_ids():
    def version():
        raise AssertionError("not asked: the answer has a weight_versions span")

    answer = {"choices": [{"text": "x", "token_ids": [7, 8], "logprobs": {"token_logprobs": [-1.0, -2.0]},
                           "finish_reason": "length", "weight_versions": [{"version": "v", "start": 0, "end": 2}]}]}
    out = va.from_vllm_response(answer, rid="r", input_ids=[1, 2, 3], max_tokens=2, return_logprob=True,
                                current_version=version)
    assert out["output_ids"] == [7, 8] and out["meta_info"]["weight_version"] == "v"
    assert out["meta_info"]["output_token_logprobs"] == [[-1.0, 7, None], [-2.0, 8, None]]
    bad = {"choices": [{"text": "x", "token_ids": [7, 8], "logprobs": {"token_logprobs": [-1.0]},
                        "finish_reason": "stop"}]}
    with pytest.raises(va.RequestError, match="one log-prob per output token"):
        va.from_vllm_response(bad, rid="r", input_ids=[1], max_tokens=2, return_logprob=True, current_version=version)
    with pytest.raises(va.RequestError, match="token_id"):
        va.from_vllm_response({"choices": [{"logprobs": {"tokens": ["hello"]}, "finish_reason": "stop"}]},
                              rid="r", input_ids=[1], max_tokens=1, return_logprob=False, current_version=version)
    no_prompt = {"choices": [{"text": "", "token_ids": [0], "finish_reason": "length", "prompt_logprobs": None}]}
    with pytest.raises(va.RequestError, match="prompt_logprobs entry per prompt token"):
        va.from_vllm_response(no_prompt, rid="r", input_ids=[1, 2], max_tokens=0, return_logprob=True,
                              current_version=lambda: "v", logprob_start_len=0)


def test_server_info_satisfies_slime_discovery_fields():
    with replayed(reuse=True) as (url, _, _):
        info = get(f"{url}/server_info")
        assert info["tp_size"] == 2 and info["enable_memory_saver"] is False and info["disaggregation_mode"] == "null"
        assert info["weight_version"] == "default"  # read from vLLM's /weight_info
        assert get(f"{url}/health_generate")["status"] == "ok"


def test_vllm_without_the_weight_version_api_is_refused_before_any_change():
    """An older vLLM (or one without VLLM_SERVER_DEV_MODE): /weight_info is FastAPI's 404."""
    with replayed(exchanges=[]) as (url, replay, _):
        with pytest.raises(urllib.error.HTTPError) as err:
            post(f"{url}/update_weights_from_disk", {"model_path": "/ckpt/x"})
        msg = json.loads(err.value.read())["error"]
        assert err.value.code == 502 and "/weight_info" in msg and "VLLM_SERVER_DEV_MODE=1" in msg
        assert [p for _, p, _ in replay.seen] == ["/weight_info"]  # no reload was attempted


def test_pause_abort_in_flight_then_continue():
    payload = toy.SCENARIO[8][2]  # recorded: input_ids [4], max_new_tokens 2
    with replayed(reuse=True, delay=2.0) as (url, _, adapter):
        results = {}
        t = threading.Thread(target=lambda: results.setdefault("a", post(f"{url}/generate", {
            **payload, "return_logprob": False})))
        t.start()
        for _ in range(200):
            if adapter._inflight:
                break
            time.sleep(0.01)
        assert adapter._inflight
        post(f"{url}/pause_generation", {})
        t.join(10)
        assert results["a"]["meta_info"]["finish_reason"]["type"] == "abort" and results["a"]["output_ids"] == []
        # while paused a new request waits; continue releases it
        t2 = threading.Thread(target=lambda: results.setdefault("b", post(f"{url}/generate", payload)))
        t2.start()
        time.sleep(0.3)
        assert "b" not in results
        post(f"{url}/continue_generation", {})
        t2.join(10)
        assert results["b"]["output_ids"] == expected_generate(payload, "")["output_ids"]


def test_adapter_serves_the_whole_surface_with_the_same_input_checks():
    """The endpoints and refusals of the shared SGLang surface (sglang_protocol, http_server), not a route table of its own."""
    with replayed(reuse=True) as (url, replay, _):
        assert get(f"{url}/model_info")["model_path"] == "toy" and get(f"{url}/get_model_info")["is_generation"] is True
        assert get(f"{url}/v1/loads")["loads"][0]["num_running_reqs"] == 0
        assert post(f"{url}/post_process_weights", {})["success"] is True
        ok = post(f"{url}/generate", {**toy.SCENARIO[8][2], "background": False, "model": None,
                                      "log_metrics": True})  # slime's router
        assert ok["output_ids"] == expected_generate(toy.SCENARIO[8][2], "")["output_ids"]
        for path, body, needle in [
            ("/generate", {"input_ids": [1], "return_bytes": True}, "would change the result"),
            ("/generate", {"input_ids": [1], "return_text_in_logprobs": True}, "unknown /generate keys"),
            ("/generate", {"input_ids": [1], "rid": 7}, "rid must be a string"),
            ("/generate", {"input_ids": [1], "return_logprob": "yes"}, "return_logprob must be true or false"),
            ("/generate", {"input_ids": [1], "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
            ("/generate", {"input_ids": [1], "return_logprob": True, "top_logprobs_num": 1.5}, "top_logprobs_num"),
            ("/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, "must be below"),
            ("/abort_request", {"abort_all": "yes"}, "abort_all must be true or false"),
            ("/pause_generation", {"mode": "sideways"}, "mode must be"),
            ("/update_weights_from_disk", {}, "model_path"),
            ("/update_weights_from_disk", {"model_path": "/x", "weight_version": [1]}, "weight_version must be"),
            ("/resume_memory_occupation", {"tags": "weights"}, "tags must be a list"),
        ]:
            with pytest.raises(urllib.error.HTTPError) as err:
                post(f"{url}{path}", body)
            assert err.value.code == 400 and needle in json.loads(err.value.read())["error"], (path, body)
        assert replay.misses == []
        assert not [c for c in replay.seen if c[1].startswith(("/sleep", "/collective_rpc"))]
        with pytest.raises(urllib.error.HTTPError) as err:
            post(f"{url}/update_weights_from_distributed", {})
        assert err.value.code == 501


def test_backend_commands():
    b = va.BACKEND
    opts = b.defaults()
    cmd = b.vllm_command(opts, "/models/q", port=8001, tp_size=2, max_logprobs=32)
    assert cmd[:3] == ["vllm", "serve", "/models/q"] and "--enable-sleep-mode" in cmd
    assert cmd[cmd.index("--max-logprobs") + 1] == "32"
    assert json.loads(cmd[cmd.index("--additional-config") + 1]) == {"rl_config": {"enabled": True}}
    assert b.env(opts)["VLLM_SERVER_DEV_MODE"] == "1"
    assert "--update-weight-transport" in b.slime_flags(opts, ["h:1"])

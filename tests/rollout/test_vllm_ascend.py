"""vllm-ascend adapter against a stub speaking vLLM's OpenAI completions shape (loopback only).

Verified: the SGLang <-> vLLM request/response mapping, weight reload / sleep RPC sequence, pause
and abort. Not verified: a real vLLM / vllm-ascend server (not installable on this CPU host)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slime_ascend.rollout.backends import vllm_ascend as va
from slime_ascend.rollout.http_api import make_server


class FakeVLLM:
    """Answers /v1/completions like vLLM: token i of the output is prompt[-1] + i + 1, log-prob -0.1*(i+1)."""

    def __init__(self, delay: float = 0.0):
        self.calls: list[tuple[str, str, dict]] = []
        self.delay = delay

    def handler(self):
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, body, status=200):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.calls.append(("GET", self.path, {}))
                self._reply({})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else {}
                fake.calls.append(("POST", self.path, body))
                if self.path != "/v1/completions":
                    return self._reply({})
                if fake.delay:
                    time.sleep(fake.delay)
                prompt = body["prompt"]
                k = body.get("max_tokens", 16)
                stop_ids = body.get("stop_token_ids") or []
                ids = []
                for i in range(k):
                    ids.append(prompt[-1] + i + 1)
                    if ids[-1] in stop_ids:
                        break
                finish = "stop" if ids and ids[-1] in stop_ids else "length"
                self._reply({
                    "id": "cmpl-1", "object": "text_completion", "created": 0, "model": body["model"],
                    "choices": [{
                        "index": 0, "text": "".join(f"<{t}>" for t in ids),
                        "logprobs": {"text_offset": list(range(len(ids))),
                                     "token_logprobs": [-0.1 * (i + 1) for i in range(len(ids))],
                                     "tokens": [f"token_id:{t}" for t in ids], "top_logprobs": None},
                        "finish_reason": finish, "stop_reason": ids[-1] if finish == "stop" else None,
                        "prompt_logprobs": None,
                    }],
                    "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                              "total_tokens": len(prompt) + len(ids)},
                })

        return H


@contextlib.contextmanager
def running(delay: float = 0.0):
    fake = FakeVLLM(delay)
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), fake.handler())
    upstream.daemon_threads = True
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    adapter = va.VLLMAdapter(f"http://127.0.0.1:{upstream.server_address[1]}", "m", tp_size=2)
    server = make_server(adapter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", fake, adapter
    finally:
        server.shutdown()
        server.server_close()
        upstream.shutdown()
        upstream.server_close()


def post(url, body, timeout=30):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=timeout).read())


def test_request_mapping():
    body = va.to_vllm_request("m", [5, 6], {"max_new_tokens": 4, "temperature": 0.7, "top_k": -1, "stop": None,
                                            "no_stop_trim": True, "custom_params": {"x": 1}, "sampling_seed": 3})
    assert body == {"model": "m", "prompt": [5, 6], "logprobs": 0, "return_tokens_as_token_ids": True, "echo": False,
                    "stream": False, "n": 1, "max_tokens": 4, "temperature": 0.7, "top_k": -1,
                    "include_stop_str_in_output": True, "seed": 3}
    with pytest.raises(va.RequestError, match="regex"):
        va.to_vllm_request("m", [1], {"regex": "a+"})
    with pytest.raises(va.RequestError, match="input_ids"):
        va.to_vllm_request("m", [], {})
    with pytest.raises(va.RequestError, match="n=2"):
        va.to_vllm_request("m", [1], {"n": 2})


def test_response_mapping_prefers_token_ids_and_checks_lengths():
    answer = {"choices": [{"text": "x", "token_ids": [7, 8], "logprobs": {"token_logprobs": [-1.0, -2.0]},
                           "finish_reason": "length"}]}
    out = va.from_vllm_response(answer, rid="r", prompt_len=3, max_tokens=2, return_logprob=True, weight_version="v")
    assert out["output_ids"] == [7, 8]
    assert out["meta_info"]["output_token_logprobs"] == [[-1.0, 7, None], [-2.0, 8, None]]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert out["meta_info"]["prompt_tokens"] == 3
    bad = {"choices": [{"text": "x", "token_ids": [7, 8], "logprobs": {"token_logprobs": [-1.0]},
                        "finish_reason": "stop"}]}
    with pytest.raises(va.RequestError, match="one log-prob per output token"):
        va.from_vllm_response(bad, rid="r", prompt_len=1, max_tokens=2, return_logprob=True, weight_version="v")
    with pytest.raises(va.RequestError, match="token_id"):
        va.from_vllm_response({"choices": [{"logprobs": {"tokens": ["hello"]}, "finish_reason": "stop"}]},
                              rid="r", prompt_len=1, max_tokens=1, return_logprob=False, weight_version="v")


def test_generate_through_adapter_matches_slow_reference():
    from slime_ascend.rollout.engine_client import parse_generate_response

    with running() as (url, fake, _):
        for prompt, k, stops in (([3, 4], 5, None), ([10], 6, [13]), ([1, 2, 3], 1, [])):
            out = post(f"{url}/generate", {"input_ids": prompt, "return_logprob": True,
                                           "sampling_params": {"max_new_tokens": k, "stop_token_ids": stops}})
            # slow reference: what the stub generates, in SGLang's shape
            ids = []
            for i in range(k):
                ids.append(prompt[-1] + i + 1)
                if stops and ids[-1] in stops:
                    break
            res = parse_generate_response(out)
            assert res.token_ids == ids == out["output_ids"]
            assert res.log_probs == pytest.approx([-0.1 * (i + 1) for i in range(len(ids))])
            assert res.finish_reason == ("stop" if stops and ids[-1] in stops else "length")
            sent = fake.calls[-1][2]
            assert sent["prompt"] == prompt and sent["max_tokens"] == k and sent["logprobs"] == 0


def test_server_info_satisfies_slime_discovery_fields():
    with running() as (url, _, _):
        info = json.loads(urllib.request.urlopen(f"{url}/server_info", timeout=10).read())
        assert info["tp_size"] == 2 and info["enable_memory_saver"] is False and info["disaggregation_mode"] == "null"
        assert json.loads(urllib.request.urlopen(f"{url}/health_generate", timeout=10).read())["status"] == "ok"


def test_weight_reload_and_sleep_rpc_sequence():
    with running() as (url, fake, adapter):
        out = post(f"{url}/update_weights_from_disk", {"model_path": "/ckpt/iter_3", "weight_version": "3"})
        assert out["success"] and adapter.weight_version == "3"
        rpcs = [(p, b) for m, p, b in fake.calls if m == "POST"]
        assert rpcs == [("/collective_rpc", {"method": "update_config", "args": [{"model_config": {"model": "/ckpt/iter_3"}}]}),
                        ("/collective_rpc", {"method": "reload_weights"}), ("/reset_prefix_cache", {})]
        post(f"{url}/release_memory_occupation", {})
        post(f"{url}/resume_memory_occupation", {"tags": ["weights"]})
        assert [p for _, p, _ in fake.calls[-2:]] == ["/sleep?level=1", "/wake_up?tags=weights"]
        assert json.loads(urllib.request.urlopen(f"{url}/get_weight_version", timeout=10).read()) == {"weight_version": "3"}
        with pytest.raises(urllib.error.HTTPError) as err:
            post(f"{url}/update_weights_from_distributed", {})
        assert err.value.code == 501


def test_pause_abort_in_flight_then_continue():
    with running(delay=2.0) as (url, fake, adapter):
        results = {}
        t = threading.Thread(target=lambda: results.setdefault("a", post(f"{url}/generate", {
            "input_ids": [1], "return_logprob": True, "sampling_params": {"max_new_tokens": 2}})))
        t.start()
        for _ in range(200):
            if adapter._inflight:
                break
            time.sleep(0.01)
        assert adapter._inflight
        post(f"{url}/pause_generation", {})
        t.join(10)
        assert results["a"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert results["a"]["meta_info"]["output_token_logprobs"] == []
        # while paused a new request waits; continue releases it
        t2 = threading.Thread(target=lambda: results.setdefault("b", post(f"{url}/generate", {
            "input_ids": [1], "return_logprob": True, "sampling_params": {"max_new_tokens": 2}})))
        t2.start()
        time.sleep(0.3)
        assert "b" not in results
        post(f"{url}/continue_generation", {})
        t2.join(10)
        assert results["b"]["output_ids"] == [2, 3]


def test_bad_request_is_a_400():
    with running() as (url, _, _):
        with pytest.raises(urllib.error.HTTPError) as err:
            post(f"{url}/generate", {"text": "hello"})
        assert err.value.code == 400 and "input_ids" in json.loads(err.value.read())["error"]


def test_adapter_serves_the_whole_surface_with_the_same_input_checks():
    """The endpoints and refusals of the shared SGLang surface (http_api), not a route table of its own."""
    with running() as (url, fake, _):
        def get(path):
            return json.loads(urllib.request.urlopen(f"{url}{path}", timeout=10).read())

        assert get("/model_info")["model_path"] == "m" and get("/get_model_info")["is_generation"] is True
        assert get("/v1/loads")["loads"][0]["num_running_reqs"] == 0
        assert post(f"{url}/post_process_weights", {})["success"] is True
        ok = post(f"{url}/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1},
                                      "background": False, "model": None, "log_metrics": True})  # slime's router
        assert ok["output_ids"] == [2]
        for path, body, needle in [
            ("/generate", {"input_ids": [1], "return_bytes": True}, "would change the result"),
            ("/generate", {"input_ids": [1], "logprob_start_len": 0}, "unknown /generate keys"),
            ("/generate", {"input_ids": [1], "rid": 7}, "rid must be a string"),
            ("/generate", {"input_ids": [1], "return_logprob": "yes"}, "return_logprob must be true or false"),
            ("/abort_request", {"abort_all": "yes"}, "abort_all must be true or false"),
            ("/pause_generation", {"mode": "sideways"}, "mode must be"),
            ("/update_weights_from_disk", {}, "model_path"),
            ("/resume_memory_occupation", {"tags": "weights"}, "tags must be a list"),
        ]:
            with pytest.raises(urllib.error.HTTPError) as err:
                post(f"{url}{path}", body)
            assert err.value.code == 400 and needle in json.loads(err.value.read())["error"], (path, body)
        assert not [c for c in fake.calls if c[1] in ("/sleep?level=1", "/collective_rpc")]


def test_backend_commands():
    b = va.BACKEND
    opts = b.defaults()
    cmd = b.vllm_command(opts, "/models/q", port=8001, tp_size=2)
    assert cmd[:3] == ["vllm", "serve", "/models/q"] and "--enable-sleep-mode" in cmd
    assert json.loads(cmd[cmd.index("--additional-config") + 1]) == {"rl_config": {"enabled": True}}
    assert b.env(opts)["VLLM_SERVER_DEV_MODE"] == "1"
    assert "--update-weight-transport" in b.slime_flags(opts, ["h:1"])

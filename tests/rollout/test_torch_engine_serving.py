"""The torch engine behind slime's sglang router, its per-request limits and CLI flags, abort of
queued batch prompts, and the weight-update drain."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from conftest import need
import torch

from slime_ascend.rollout.torch_engine import model as reference_model
from slime_ascend.rollout.torch_engine.cli import build_parser
from slime_ascend.rollout.torch_engine.engine import TorchEngine
from slime_ascend.rollout.torch_engine.model import load_model, save_model, score_tokens

import torch_engine_fixtures
from torch_engine_fixtures import PROMPT, post_in_thread

HTTP = httpx.Client(timeout=120, trust_env=False)
engine, url = torch_engine_fixtures.engine, torch_engine_fixtures.url  # pytest fixtures
# what slime's sglang router adds to every /generate body it forwards (sglang-router 0.3)
ROUTER_KEYS = {"background": False, "model": None, "no_logs": False, "return_bytes": False,
               "return_entropy": False, "log_metrics": True}


def test_router_keys_at_neutral_values_are_accepted_and_change_nothing(url):
    payload = {"input_ids": PROMPT, "sampling_params": {"temperature": 0.8, "max_new_tokens": 6, "sampling_seed": 3},
               "return_logprob": True, "stream": False, "return_hidden_states": False, "return_text_in_logprobs": False}
    plain = HTTP.post(f"{url}/generate", json=payload)
    routed = HTTP.post(f"{url}/generate", json={**payload, **ROUTER_KEYS})
    assert plain.status_code == 200 and routed.status_code == 200, routed.text
    assert routed.json()["output_ids"] == plain.json()["output_ids"]
    lps = [lp for lp, _, _ in routed.json()["meta_info"]["output_token_logprobs"]]
    assert lps == [lp for lp, _, _ in plain.json()["meta_info"]["output_token_logprobs"]]
    assert HTTP.post(f"{url}/generate", json={**payload, "log_metrics": False}).status_code == 200


@pytest.mark.parametrize("key", sorted(ROUTER_KEYS))
def test_each_router_key_alone_at_its_neutral_value_is_accepted(url, key):
    r = HTTP.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}, key: ROUTER_KEYS[key]})
    assert r.status_code == 200, r.text


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_generate_through_the_real_sglang_router(tmp_path):
    """slime's router (sglang-router) in front of the engine: /generate answers 200 with the same tokens."""
    need("sglang_router")
    model_dir = save_model(load_model(None, seed=3), tmp_path / "m", reference_model.build_byte_tokenizer())
    engine = TorchEngine(model_path=str(model_dir), return_original_logprob=False)
    port = _free_port()
    blackhole = "http://127.0.0.1:9"  # the router must not reach the internet (it would fetch a tokenizer)
    env = {**os.environ, "HTTP_PROXY": blackhole, "HTTPS_PROXY": blackhole, "http_proxy": blackhole,
           "https_proxy": blackhole, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
           "HF_HUB_OFFLINE": "1"}
    payload = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 4}, "return_logprob": True}
    with engine.start_in_thread() as base:
        direct = HTTP.post(f"{base}/generate", json=payload).json()
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--worker-urls", base, "--log-level", "error", "--worker-startup-timeout-secs", "30"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        )
        try:
            deadline, response = time.monotonic() + 60, None
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    response = HTTP.post(f"http://127.0.0.1:{port}/generate", json=payload, timeout=10)
                    if response.status_code != 503:  # 503 while the router has no healthy worker yet
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.3)
            assert response is not None and response.status_code == 200, response and response.text
            assert response.json()["output_ids"] == direct["output_ids"]
        finally:
            proc.kill()
            proc.wait(10)


# ---------------------------------------------------------------- limits and flags


def test_limits_are_constructor_args_and_cli_flags():
    args = build_parser().parse_args(
        ["--max-batch-size", "8", "--max-prompt-tokens", "100", "--max-new-tokens", "50", "--timeout", "2.5",
         "--backlog", "300", "--max-connections", "40", "--max-body-bytes", "4096", "--max-top-logprobs", "7"]
    )
    assert args.max_top_logprobs == 7
    assert (args.max_batch_size, args.max_prompt_tokens, args.max_new_tokens) == (8, 100, 50)
    assert (args.timeout, args.backlog, args.max_connections, args.max_body_bytes) == (2.5, 300, 40, 4096)
    defaults = build_parser().parse_args([])
    assert defaults.max_batch_size >= 1 and defaults.timeout > 0 and defaults.backlog >= 200
    for bad in (["--max-batch-size", "0"], ["--timeout", "-1"], ["--backlog", "x"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)
    with pytest.raises(ValueError, match="max_new_tokens"):
        TorchEngine(max_new_tokens=0)
    engine = TorchEngine(max_batch_size=2, max_prompt_tokens=10, max_new_tokens=5)
    info = engine.server_info()
    assert (info["max_batch_size"], info["max_prompt_tokens"], info["max_new_tokens"]) == (2, 10, 5)


# ---------------------------------------------------------------- abort and drain


def _wait_running(url: str, n: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if HTTP.get(f"{url}/v1/loads").json()["loads"][0]["num_running_reqs"] >= n:
            return
        time.sleep(0.002)
    raise AssertionError("request never started running")


def test_abort_all_aborts_the_queued_prompts_of_a_batch():
    engine = TorchEngine(return_original_logprob=False)
    with engine.start_in_thread() as base:
        batch = {"input_ids": [[1, 2], [3, 4], [5, 6]],
                 "sampling_params": {"temperature": 1.0, "max_new_tokens": 4000, "ignore_eos": True}}
        thread, box = post_in_thread(base, batch)
        _wait_running(base, 1)
        loads = HTTP.get(f"{base}/v1/loads").json()["loads"][0]
        assert loads["num_waiting_reqs"] == 2  # the queued prompts are visible
        assert HTTP.post(f"{base}/abort_request", json={"abort_all": True}).json()["num_aborted"] == 3
        thread.join(60)
        outs = box["response"]
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort"] * 3
        assert outs[0]["meta_info"]["completion_tokens"] < 4000
        assert [o["meta_info"]["completion_tokens"] for o in outs[1:]] == [0, 0]


def test_abort_by_rid_reaches_a_queued_batch_prompt():
    engine = TorchEngine(return_original_logprob=False)
    with engine.start_in_thread() as base:
        sp = {"temperature": 1.0, "max_new_tokens": 300, "ignore_eos": True}
        thread, box = post_in_thread(base, {"input_ids": [[1, 2], [3, 4]], "sampling_params": sp, "rid": ["a", "b"]})
        _wait_running(base, 1)
        assert HTTP.post(f"{base}/abort_request", json={"rid": "b"}).json()["num_aborted"] == 1
        thread.join(120)
        first, second = box["response"]
        assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
        assert second["meta_info"]["finish_reason"]["type"] == "abort"


def test_weight_update_waits_for_in_flight_generation(tmp_path):
    """The update returns only after the running request finished, every token of which came from the
    old weights (its log-probs equal the old model's training forward)."""
    engine = TorchEngine(return_original_logprob=False)
    old = load_model(None)
    new_dir = save_model(load_model(None, seed=7), tmp_path / "new")
    with engine.start_in_thread() as base:
        sp = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
        thread, box = post_in_thread(base, {"input_ids": PROMPT, "sampling_params": sp, "return_logprob": True})
        _wait_running(base, 1)
        r = HTTP.post(f"{base}/update_weights_from_disk", json={"model_path": str(new_dir), "weight_version": "2"})
        assert r.status_code == 200
        assert not thread.is_alive() and "response" in box  # answered before the update returned
        out = box["response"]
        assert out["meta_info"]["weight_version"] == "default"
        expected = score_tokens(old, PROMPT + out["output_ids"])[len(PROMPT) - 1 :]
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        after = HTTP.post(f"{base}/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}).json()
        assert after["meta_info"]["weight_version"] == "2"

"""Replayed bad inputs and faults for the reference rollout engine (issues 14 and 15): each answers
a 4xx naming the field, or is bounded, and the engine keeps serving its old weights.

Loopback only, small counts, short timeouts. The FIFO case runs the engine in a child process: before
the fix, reading a FIFO held the GIL and froze the whole process (the test process too, in-process).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from slime_ascend import files
from slime_ascend.rollout.http_server import make_server
from slime_ascend.rollout.torch_engine.engine import TorchEngine
from slime_ascend.rollout.torch_engine.model import save_model

import torch_engine_fixtures
from torch_engine_fixtures import PROMPT

HTTP = httpx.Client(timeout=30, trust_env=False)
engine, url = torch_engine_fixtures.engine, torch_engine_fixtures.url  # pytest fixtures
GREEDY = {"temperature": 0, "max_new_tokens": 4}


@pytest.fixture(scope="module")
def good_dir(engine, tmp_path_factory) -> Path:
    """A checkpoint of the engine's own weights (loading it changes nothing but the version)."""
    return save_model(engine.model, tmp_path_factory.mktemp("good"))


def variant(good_dir: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    out = tmp_path / name
    shutil.copytree(good_dir, out)
    return out


def greedy_ids(url: str) -> list[int]:
    r = HTTP.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def update(url: str, path: Path | str, **extra):
    return HTTP.post(f"{url}/update_weights_from_disk", json={"model_path": str(path), **extra})


def raw_post(url: str, path: str, body: bytes, timeout: float = 30) -> tuple[int, dict]:
    r = HTTP.post(f"{url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=timeout)
    return r.status_code, r.json()


# ---------------------------------------------------------------- /generate bad input


@pytest.mark.parametrize(
    ("key", "value"),
    [("background", True), ("model", "other-model"), ("no_logs", True), ("return_bytes", True),
     ("return_entropy", True), ("log_metrics", "yes"), ("background", None), ("return_entropy", 0)],
)
def test_router_key_with_non_neutral_value_is_400_naming_it(url, key, value):
    status, body = raw_post(url, "/generate", json.dumps({"input_ids": PROMPT, key: value}).encode())
    assert status == 400 and key in body["error"]


def test_unknown_generate_key_is_400_naming_it(url):
    status, body = raw_post(url, "/generate", json.dumps({"input_ids": PROMPT, "return_everything": True}).encode())
    assert status == 400 and "return_everything" in body["error"]


@pytest.mark.parametrize(
    ("payload", "status", "words"),
    [
        ({"input_ids": [[1, 2]] * 5}, 413, ("max_batch_size", "--max-batch-size", "5")),
        ({"input_ids": [[1, 2, 3, 4, 5, 6]] * 4}, 413, ("--max-prompt-tokens", "24")),
        ({"input_ids": list(range(1, 22))}, 413, ("--max-prompt-tokens", "21")),
        ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 33}}, 400, ("max_new_tokens", "--max-new-tokens")),
        ({"input_ids": [[1], [2]], "sampling_params": [{}, {"max_new_tokens": 33}]}, 400, ("--max-new-tokens",)),
    ],
)
def test_requests_over_the_limits_are_4xx_naming_the_flag(payload, status, words):
    engine = TorchEngine(max_batch_size=4, max_prompt_tokens=20, max_new_tokens=32)
    with engine.start_in_thread() as base:
        got, body = raw_post(base, "/generate", json.dumps(payload).encode())
        assert got == status, body
        assert all(w in body["error"] for w in words), body["error"]
        # at the limits exactly, the request is served
        ok = {"input_ids": [[1, 2, 3, 4, 5]] * 4, "sampling_params": {"max_new_tokens": 32, "ignore_eos": True}}
        r = HTTP.post(f"{base}/generate", json=ok)
        assert r.status_code == 200 and [o["meta_info"]["completion_tokens"] for o in r.json()] == [32] * 4


def test_oversized_body_is_413_before_it_is_read(engine):
    server = make_server(engine, max_body_bytes=1000)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = "http://%s:%d" % server.server_address[:2]
        status, body = raw_post(base, "/generate", json.dumps({"input_ids": [5] * 500}).encode())
        assert status == 413 and "--max-body-bytes" in body["error"]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "body",
    [b"[" * 100_000 + b"]" * 100_000, b'{"input_ids": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
     b'{"input_ids": [' + b"9" * 5000 + b"]}"],
    ids=["nested-array", "nested-field", "huge-int"],
)
def test_deeply_nested_or_huge_json_body_is_400(url, body):
    for path in ("/generate", "/update_weights_from_disk", "/abort_request"):
        status, answer = raw_post(url, path, body)
        assert status == 400, (path, answer)
        assert "JSON" in answer["error"] or "nested" in answer["error"]
    assert HTTP.get(f"{url}/health").status_code == 200


# ---------------------------------------------------------------- update_weights_from_disk bad checkpoints


def _write_state(ckpt: Path, mutate) -> None:
    path = ckpt / "model.safetensors"
    state = load_file(str(path))
    mutate(state)
    save_file(state, str(path), metadata={"format": "pt"})


def _nan(state):
    state["model.layers.0.mlp.down_proj.weight"][3, 5] = float("nan")


def _inf(state):
    state["lm_head.weight"][0, 0] = float("inf")


def _overflow_bf16(state):  # finite in float64, inf once cast to the engine's float32
    state["model.norm.weight"] = state["model.norm.weight"].double() * 1e300


def _int_dtype(state):
    state["model.layers.1.self_attn.q_proj.weight"] = torch.zeros_like(state["model.layers.1.self_attn.q_proj.weight"], dtype=torch.int32)


def _bool_dtype(state):
    state["model.norm.weight"] = torch.ones_like(state["model.norm.weight"], dtype=torch.bool)


def _shape(state):
    state["model.norm.weight"] = torch.ones(65)


BAD_TENSORS = [
    (_nan, ("non-finite", "down_proj")),
    (_inf, ("non-finite", "lm_head")),
    (_overflow_bf16, ("non-finite", "model.norm.weight")),
    (_int_dtype, ("dtype", "q_proj", "int32")),
    (_bool_dtype, ("dtype", "model.norm.weight", "bool")),
    (_shape, ("shape", "model.norm.weight")),
]


@pytest.mark.parametrize(("mutate", "words"), BAD_TENSORS, ids=[m.__name__.strip("_") for m, _ in BAD_TENSORS])
def test_bad_tensors_are_refused_and_old_weights_keep_serving(url, good_dir, tmp_path, mutate, words):
    before = greedy_ids(url)
    version = HTTP.get(f"{url}/get_weight_version").json()["weight_version"]
    ckpt = variant(good_dir, tmp_path)
    _write_state(ckpt, mutate)
    r = update(url, ckpt, weight_version="bad")
    assert r.status_code == 400, r.text
    assert all(w in r.json()["error"] for w in words), r.json()["error"]
    assert HTTP.get(f"{url}/get_weight_version").json()["weight_version"] == version
    out = HTTP.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True}).json()
    assert out["output_ids"] == before
    assert all(torch.isfinite(torch.tensor(lp)) for lp, _, _ in out["meta_info"]["output_token_logprobs"])


CORRUPT_FILES = {
    "truncated": lambda data: data[: len(data) // 2],
    "garbage": lambda data: b"\x00garbage" * 100,
    "empty": lambda data: b"",
    "header-too-long": lambda data: (2**62).to_bytes(8, "little") + data[8:],
    "header-not-json": lambda data: len(b"{not json}").to_bytes(8, "little") + b"{not json}" + data[8:],
    "header-nested": lambda data: (20008).to_bytes(8, "little") + b"[" * 10004 + b"]" * 10004,
}


@pytest.mark.parametrize("name", list(CORRUPT_FILES))
def test_corrupt_safetensors_is_400_naming_the_file(url, good_dir, tmp_path, name):
    ckpt = variant(good_dir, tmp_path)
    path = ckpt / "model.safetensors"
    path.write_bytes(CORRUPT_FILES[name](path.read_bytes()))
    r = update(url, ckpt)
    assert r.status_code == 400, r.text
    assert "model.safetensors" in r.json()["error"]
    assert HTTP.get(f"{url}/get_weight_version").json()["weight_version"] == "default"


BAD_CONFIGS = {
    "nested": ("[" * 100_000 + "]" * 100_000, ("config.json", "nested")),
    "not-json": ("{oops", ("config.json", "not valid JSON")),
    "not-object": ("[1, 2]", ("config.json", "JSON object")),
    "quant-config-list": ('{"quantization_config": [1]}', ("config.json", "quantization_config")),
    "quant-method-int": ('{"quantization_config": {"quant_method": 8}}', ("config.json", "quant_method")),
    "fp8-missing-block-size": ('{"quantization_config": {"quant_method": "fp8"}}', ("quantization_config",)),
    "ct-missing-groups": ('{"quantization_config": {"quant_method": "compressed-tensors"}}', ("quantization_config",)),
    "hidden-size-string": ('{"hidden_size": "64"}', ("config.json", "hidden_size")),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_config_json_is_400_naming_file_and_field(url, good_dir, tmp_path, name):
    text, words = BAD_CONFIGS[name]
    ckpt = variant(good_dir, tmp_path)
    (ckpt / "config.json").write_text(text)
    r = update(url, ckpt)
    assert r.status_code == 400, r.text
    assert all(w in r.json()["error"] for w in words), r.json()["error"]
    assert HTTP.get(f"{url}/health").status_code == 200


def test_oversized_checkpoint_is_refused_before_reading(engine, good_dir, tmp_path):
    ckpt = variant(good_dir, tmp_path)
    with open(ckpt / "extra.safetensors", "wb") as f:  # sparse: no disk used
        f.truncate(engine._max_checkpoint_bytes + 1)
    with engine.start_in_thread() as base:
        r = update(base, ckpt)
    assert r.status_code == 400 and "at most" in r.json()["error"]


def test_slow_load_keeps_health_and_generate_answering(good_dir, monkeypatch):
    """A slow disk stalls only the updating thread: /health and /generate keep answering, old weights
    serve until the swap."""
    engine = TorchEngine(return_original_logprob=False)
    loading = threading.Event()
    real_read = files._read_chunk

    def slow_read(fd, size):
        loading.set()
        time.sleep(0.15)  # a stalled network filesystem, 64 KiB at a time
        return real_read(fd, size)

    monkeypatch.setattr(files, "_read_chunk", slow_read)
    monkeypatch.setattr(files, "_READ_CHUNK", 64 * 1024)
    with engine.start_in_thread() as base:
        box = {}
        updater = threading.Thread(target=lambda: box.setdefault("r", update(base, good_dir, weight_version="2")))
        updater.start()
        assert loading.wait(10)
        latencies = []
        for _ in range(3):
            t0 = time.monotonic()
            assert HTTP.get(f"{base}/health", timeout=5).status_code == 200
            out = HTTP.post(f"{base}/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}, timeout=5)
            latencies.append(time.monotonic() - t0)
            assert out.status_code == 200 and out.json()["meta_info"]["weight_version"] == "default"
        assert updater.is_alive(), "the load finished too fast to test anything"
        assert max(latencies) < 1.0, latencies
        updater.join(30)
        assert box["r"].status_code == 200
        assert HTTP.get(f"{base}/get_weight_version").json()["weight_version"] == "2"


# ---------------------------------------------------------------- FIFO / special files (child process)


@pytest.fixture(scope="module")
def child_url():
    """The engine served by ``slime-ascend serve-torch`` in a child process (killed afterwards)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "slime_ascend.rollout.torch_engine.cli", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        line = proc.stdout.readline()  # "torch engine serving ... at http://127.0.0.1:PORT"
        assert " at http://127.0.0.1:" in line, line
        yield line.rsplit(" at ", 1)[1].strip()
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize("special", ["model.safetensors", "config.json", "extra.safetensors"])
def test_fifo_in_checkpoint_is_refused_without_freezing_the_engine(child_url, good_dir, tmp_path, special):
    ckpt = variant(good_dir, tmp_path)
    target = ckpt / special
    target.unlink(missing_ok=True)
    os.mkfifo(target)
    box = {}

    def post():
        try:
            box["r"] = update(child_url, ckpt)
        except httpx.HTTPError as exc:
            box["r"] = exc

    updater = threading.Thread(target=post, daemon=True)
    updater.start()
    updater.join(0.3)
    t0 = time.monotonic()
    health = HTTP.get(f"{child_url}/health", timeout=5)  # before the fix: frozen (GIL held by the read)
    assert health.status_code == 200 and time.monotonic() - t0 < 2
    updater.join(5)
    r = box.get("r")
    assert isinstance(r, httpx.Response) and r.status_code == 400, r
    assert special in r.json()["error"] and "FIFO" in r.json()["error"]
    assert HTTP.get(f"{child_url}/get_weight_version", timeout=5).json()["weight_version"] == "default"


def test_symlink_to_device_is_refused(url, good_dir, tmp_path):
    ckpt = variant(good_dir, tmp_path)
    (ckpt / "zeros.safetensors").symlink_to("/dev/zero")
    r = update(url, ckpt)
    assert r.status_code == 400 and "zeros.safetensors" in r.json()["error"]


# ---------------------------------------------------------------- connections


def _serve(engine, **kwargs):
    server = make_server(engine, **kwargs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[:2]


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_200_concurrent_clients_are_all_answered(engine):
    """The listen backlog was 5: a burst of 200 connections lost 10-46% of them."""
    server, (host, port) = _serve(engine)
    n = 200
    barrier = threading.Barrier(n)
    results: list[object] = [None] * n

    def client(i: int) -> None:
        barrier.wait()
        try:
            with socket.create_connection((host, port), timeout=10) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                results[i] = _read_all(sock).split(b" ", 2)[1].decode()
        except OSError as exc:
            results[i] = type(exc).__name__

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert Counter(results) == {"200": n}
    finally:
        server.shutdown()
        server.server_close()


def test_client_disconnect_stops_generation(monkeypatch):
    engine = TorchEngine(return_original_logprob=False)
    steps = []
    real_forward = engine._forward

    def slow_forward(seq, ids):
        steps.append(time.monotonic())
        time.sleep(0.005)  # 4000 steps would take >= 20 s
        return real_forward(seq, ids)

    monkeypatch.setattr(engine, "_forward", slow_forward)
    with engine.start_in_thread() as base:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        body = json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}).encode()
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(b"POST /generate HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 10
        while len(steps) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        sock.close()
        closed = time.monotonic()
        while time.monotonic() - closed < 5 and engine.loads()["loads"][0]["num_total_reqs"]:
            time.sleep(0.02)
        assert engine.loads()["loads"][0]["num_total_reqs"] == 0
        assert len([t for t in steps if t > closed]) < 100, "generation kept running after the client left"


def test_a_small_request_cannot_ask_for_a_huge_answer():
    """top_logprobs_num amplifies: k entries per scored and new position. Counted by hand: 2 prompts x
    (6 scored positions from logprob_start_len 0 + 4 new tokens) x k=50 = 1000 entries; the limit is 999."""
    engine = TorchEngine(max_top_logprobs=999)
    payload = {"input_ids": [[1, 2, 3, 4, 5, 6]] * 2, "return_logprob": True, "logprob_start_len": 0,
               "top_logprobs_num": 50, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    with engine.start_in_thread() as base:
        got, body = raw_post(base, "/generate", json.dumps(payload).encode())
        assert got == 413, body
        assert "1000 top-k log-prob entries" in body["error"] and "--max-top-logprobs" in body["error"]
        # without input log-probs the same k costs only the new positions: 2 x 4 x 50 = 400, served
        r = HTTP.post(f"{base}/generate", json={**payload, "logprob_start_len": -1})
        assert r.status_code == 200 and all(len(o["meta_info"]["output_top_logprobs"]) == 4 for o in r.json())
        assert HTTP.get(f"{base}/server_info").json()["max_top_logprobs"] == 999


@pytest.mark.parametrize("bad", ["", True, -1, "x" * 10_000, "v 2", 1.5, ["1"]])
def test_a_weight_version_outside_the_rule_is_400_and_nothing_loads(url, good_dir, bad):
    version = HTTP.get(f"{url}/get_weight_version").json()["weight_version"]
    r = update(url, good_dir, weight_version=bad)
    assert r.status_code == 400, r.text
    assert "weight_version must be a non-negative integer or a word" in r.json()["error"]
    assert len(r.json()["error"]) < 300  # a 10 KB value is not echoed back whole
    assert HTTP.get(f"{url}/get_weight_version").json()["weight_version"] == version


@pytest.mark.parametrize(("given", "stored"), [(7, "7"), ("12", "12"), ("policy-v3.1", "policy-v3.1")])
def test_a_weight_version_inside_the_rule_is_stored(url, good_dir, given, stored):
    r = update(url, good_dir, weight_version=given)
    assert r.status_code == 200, r.text
    assert HTTP.get(f"{url}/get_weight_version").json()["weight_version"] == stored

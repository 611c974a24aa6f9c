"""The torch engine's ``/get_weights_by_name`` (torch_engine/weight_read.py): SGLang's request and answer (the first
``truncate_size`` rows as a float32 list), the exact bytes with ``return_raw`` (float8 and int8 checkpoints
included), the served version's tensors after a disk update and across a release/resume, and its refusals (a
name not held, bad fields, an answer above ``max_weight_values``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from slime_ascend.rollout.torch_engine.engine import TorchEngine
from torch_engine_fixtures import bf16_dir
from slime_ascend.rollout.torch_engine.weight_read import decode_raw

HTTP = httpx.Client(trust_env=False, timeout=60)
NAME = "model.layers.0.self_attn.q_proj.weight"


def read(url: str, name: str, method: str = "POST", **fields) -> httpx.Response:
    return HTTP.request(method, url + "/get_weights_by_name", json={"name": name, **fields})


def checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def test_sglang_answer_and_raw_bytes_of_an_unquantised_model():
    engine = TorchEngine(return_original_logprob=False, dtype="bfloat16", max_weight_values=5000)
    own = engine.model.state_dict()
    with engine.start_in_thread() as url:
        # SGLang's shape: the parameter as a float32 list, its first truncate_size rows (default 100)
        answer = read(url, NAME).json()
        assert answer == own[NAME].float()[:100].tolist()
        assert read(url, NAME, method="GET", truncate_size=3).json() == own[NAME].float()[:3].tolist()
        assert read(url, NAME, truncate_size=0).json() == []
        norm = "model.norm.weight"
        assert read(url, norm, truncate_size=10**9).json() == own[norm].float().tolist()

        # return_raw: the same list, plus the bytes, dtype, shapes and the version they belong to
        full = read(url, NAME, truncate_size=10**6, return_raw=True).json()
        assert full["parameter"] == own[NAME].float().tolist()
        assert full["dtype"] == "bfloat16" and full["shape"] == list(own[NAME].shape) == full["raw_shape"]
        assert full["weight_version"] == "default" and full["name"] == NAME
        assert same_bytes(decode_raw(full), own[NAME])
        two = read(url, NAME, truncate_size=2, return_raw=True).json()
        assert two["raw_shape"] == [2, own[NAME].shape[1]] and two["shape"] == list(own[NAME].shape)
        assert same_bytes(decode_raw(two), own[NAME][:2])

        # refusals, each naming what to fix; nothing of a refused request is answered
        missing = read(url, "model.layers.9.mlp.up_proj.weight")
        assert missing.status_code == 400 and "'model.layers.9.mlp.up_proj.weight'" in missing.json()["error"]
        for fields, needle in (({"truncate_size": -1}, "truncate_size"), ({"truncate_size": "5"}, "truncate_size"),
                               ({"return_raw": 1}, "return_raw"), ({"rows": 1}, "unknown fields ['rows']")):
            resp = read(url, NAME, **fields)
            assert resp.status_code == 400 and needle in resp.json()["error"], (fields, resp.text)
        assert HTTP.post(url + "/get_weights_by_name", json={}).status_code == 400
        # the answer's size is bounded: the embedding (1024 x 64 values) is above max_weight_values=5000 ...
        big = read(url, "model.embed_tokens.weight", truncate_size=10**6)
        assert big.status_code == 413 and "max_weight_values=5000" in big.json()["error"]
        assert "--max-weight-values" in big.json()["error"]
        # ... its first rows are not
        assert len(read(url, "model.embed_tokens.weight", truncate_size=78).json()) == 78


@pytest.mark.parametrize("fmt", ["fp8-block", "int8-w8a8"])
def test_quantised_engine_answers_the_checkpoint_bytes(tmp_path, fmt, monkeypatch):
    from slime_ascend.quant.checkpoint import convert_checkpoint
    from slime_ascend.rollout.torch_engine import model as reference_model

    q0, q1 = tmp_path / "q0", tmp_path / "q1"
    convert_checkpoint(bf16_dir(tmp_path / "bf16-0", 0.0), q0, fmt)
    convert_checkpoint(bf16_dir(tmp_path / "bf16-1", 0.01), q1, fmt)
    # a quantised checkpoint is read once per load: every weight file through read_regular_file, once; never
    # again by the quant package's reader (which the engine's first version used beside its own read)
    reads: list[str] = []
    real_read = reference_model.read_regular_file
    monkeypatch.setattr(reference_model, "read_regular_file", lambda p, *a, **k: reads.append(Path(p).name)
                        or real_read(p, *a, **k))

    def second_reader(*a, **k):
        raise AssertionError("the engine read the checkpoint a second time (CheckpointReader)")

    monkeypatch.setattr("slime_ascend.quant.checkpoint.CheckpointReader", second_reader)
    engine = TorchEngine(model_path=str(q0), return_original_logprob=False)
    files = sorted(p.name for p in q0.glob("*.safetensors"))
    assert sorted(r for r in reads if r.endswith(".safetensors")) == files

    def held(url: str, names) -> dict[str, tuple[str, torch.Tensor]]:
        out = {}
        for name in names:
            resp = read(url, name, truncate_size=10**6, return_raw=True)
            assert resp.status_code == 200, resp.text
            out[name] = (resp.json()["weight_version"], decode_raw(resp.json()))
        return out

    with engine.start_in_thread() as url:
        want = checkpoint(q0)
        assert any(t.dtype in (torch.float8_e4m3fn, torch.int8) for t in want.values())
        for name, (version, tensor) in held(url, want).items():
            assert version == "default" and same_bytes(tensor, want[name]), name
        # a scale is a tensor of the served checkpoint (the model itself holds none)
        scale = next(n for n in want if "scale" in n)
        assert scale not in engine.model.state_dict() and read(url, scale).status_code == 200

        reads.clear()
        resp = HTTP.post(url + "/update_weights_from_disk", json={"model_path": str(q1), "weight_version": "7"})
        assert resp.status_code == 200, resp.text
        assert sorted(r for r in reads if r.endswith(".safetensors")) == sorted(p.name for p in q1.glob("*.safetensors"))
        want = checkpoint(q1)
        for name, (version, tensor) in held(url, want).items():
            assert version == "7" and same_bytes(tensor, want[name]), name

        # released (--colocate offload): refused; resumed: the same bytes again
        assert HTTP.post(url + "/release_memory_occupation", json={}).status_code == 200
        assert read(url, scale).status_code == 503
        assert HTTP.post(url + "/resume_memory_occupation", json={}).status_code == 200
        for name, (version, tensor) in held(url, want).items():
            assert version == "7" and same_bytes(tensor, want[name]), name

        # an unquantised checkpoint then serves the model's own tensors: no scale any more
        resp = HTTP.post(url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "bf16-1"),
                                                                  "weight_version": "8"})
        assert resp.status_code == 200, resp.text
        gone = read(url, scale)
        assert gone.status_code == 400 and repr(scale) in gone.json()["error"]
        answer = read(url, NAME, truncate_size=10**6, return_raw=True).json()
        assert answer["dtype"] == "float32" and answer["weight_version"] == "8"
        assert torch.equal(decode_raw(answer), checkpoint(tmp_path / "bf16-1")[NAME].float())


def test_serve_torch_flag_sets_the_limit():
    from slime_ascend.rollout.torch_engine.cli import build_parser

    assert build_parser().parse_args(["--max-weight-values", "9"]).max_weight_values == 9
    with pytest.raises(ValueError, match="max_weight_values"):
        TorchEngine(max_weight_values=0)


# ---------------------------------------------------------------- bounded answer bytes (issue 40)
def test_answer_bytes_are_bounded_per_request_naming_the_flag():
    """A 70-byte request got a 90 MB answer: the worst-case size of an answer is checked before it is built, and
    every answer really is within that bound."""
    from slime_ascend.rollout.torch_engine.cli import build_parser
    from slime_ascend.rollout.torch_engine.weight_read import answer_bytes_bound

    engine = TorchEngine(return_original_logprob=False, max_weight_answer_bytes=200_000)
    own = engine.model.state_dict()
    embed = "model.embed_tokens.weight"  # 1024 x 64 float32
    with engine.start_in_thread() as url:
        big = read(url, embed, truncate_size=1024)
        assert big.status_code == 413, big.text
        error = big.json()["error"]
        assert "max_weight_answer_bytes=200000" in error and "--max-weight-answer-bytes" in error, error
        assert "lower truncate_size" in error and "\n" not in error
        small = read(url, embed, truncate_size=50, return_raw=True)
        assert small.status_code == 200 and len(small.content) <= 200_000
        for name, rows, raw in ((embed, 50, True), (embed, 100, False), ("model.norm.weight", 10**6, True),
                                (NAME, 7, True), (NAME, 0, True)):
            answer = read(url, name, truncate_size=rows, return_raw=raw)
            assert answer.status_code == 200, answer.text
            part = own[name][:rows]
            bound = answer_bytes_bound(part.shape, own[name].shape, own[name].element_size(), name, raw)
            assert len(answer.content) <= bound, (name, rows, raw, len(answer.content), bound)
    args = build_parser().parse_args(["--max-weight-answer-bytes", "5", "--max-weight-bytes-in-flight", "7"])
    assert (args.max_weight_answer_bytes, args.max_weight_bytes_in_flight) == (5, 7)
    with pytest.raises(ValueError, match="max_weight_bytes_in_flight=4 is below max_weight_answer_bytes=5.*Fix:"):
        TorchEngine(max_weight_answer_bytes=5, max_weight_bytes_in_flight=4)


def _stalled_request(url: str, body: bytes):
    """A raw connection that sends one request and never reads its answer (a small receive buffer: the server's
    send blocks once a few MB are queued)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((parts.hostname, parts.port))
    sock.sendall(b"POST /get_weights_by_name HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def _in_flight(url: str, want: int, within: float = 60) -> int:
    import time

    deadline = time.monotonic() + within
    while True:
        now = HTTP.get(url + "/server_info").json()["weight_answer_bytes_in_flight"]
        if now == want or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def test_answer_bytes_in_flight_are_bounded_across_connections(tmp_path):
    """Clients that never read held their whole answers (6 of them 1.8 GB): the answers being built or sent hold at
    most --max-weight-bytes-in-flight; past it a 503 with Retry-After, and what a closed client held is freed."""
    import json
    import socket
    import struct

    from slime_ascend.rollout.torch_engine.model import load_model, save_model
    from slime_ascend.rollout.torch_engine.weight_read import answer_bytes_bound

    model_dir = save_model(load_model(None, config_overrides={"vocab_size": 32768}), tmp_path / "wide")
    rows, name = 8192, "model.embed_tokens.weight"  # 8192 x 64 float32: about 11 MB of JSON
    bound = answer_bytes_bound((rows, 64), (32768, 64), 4, name, False)
    engine = TorchEngine(str(model_dir), max_weight_answer_bytes=bound,
                         max_weight_bytes_in_flight=2 * bound + 100_000)
    body = json.dumps({"name": name, "truncate_size": rows}).encode()
    with engine.start_in_thread() as url:
        stalled = [_stalled_request(url, body) for _ in range(2)]
        try:
            assert _in_flight(url, 2 * bound) == 2 * bound  # both answers held by clients that do not read
            refused = read(url, name, truncate_size=rows)
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
            error = refused.json()["error"]
            assert "--max-weight-bytes-in-flight" in error
            assert f"max_weight_bytes_in_flight={2 * bound + 100_000}" in error
            assert "\n" not in error
            assert read(url, name, truncate_size=10).status_code == 200  # a small answer still fits
        finally:
            for sock in stalled:  # reset: the server's send fails at once and frees what it held
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
        assert _in_flight(url, 0) == 0
        answer = read(url, name, truncate_size=rows)
        assert answer.status_code == 200 and len(answer.json()) == rows
        assert _in_flight(url, 0) == 0

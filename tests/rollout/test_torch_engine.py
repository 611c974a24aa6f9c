"""The reference rollout engine over HTTP: SGLang response shape, sampling, log-prob contract,
weight updates, pause/abort, and 4xx on malformed HTTP."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path

import httpx
import pytest
import torch

from slime_ascend.rollout.torch_engine import model as reference_model
from slime_ascend.rollout.http_server import make_server
from slime_ascend.rollout.torch_engine.cli import build_parser
from slime_ascend.rollout.torch_engine.engine import TorchEngine
from slime_ascend.rollout.torch_engine.model import load_model, save_model, score_tokens

import torch_engine_fixtures
from torch_engine_fixtures import PROMPT, post_in_thread

HTTP = httpx.Client(timeout=300, trust_env=False)  # thread-safe; no proxies for loopback
engine, url = torch_engine_fixtures.engine, torch_engine_fixtures.url  # pytest fixtures


def gen(url: str, **payload) -> dict:
    payload.setdefault("input_ids", PROMPT)
    r = HTTP.post(f"{url}/generate", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------- slow references


@torch.no_grad()
def full_logits(model, ids: list[int]) -> torch.Tensor:
    """Float32 logits [len(ids), V] from one forward pass without a KV cache."""
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Token-by-token argmax over full re-forwards (no cache): obviously right, slow."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(full_logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def perturbed_copy(model, scale: float = 0.5, seed: int = 1):
    """A copy of ``model`` with all floating weights shifted by seeded noise."""
    new = load_model(None)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for (name, p), (_, q) in zip(model.state_dict().items(), new.state_dict().items(), strict=True):
            q.copy_(p + scale * torch.randn(p.shape, generator=g))
    return new


# ---------------------------------------------------------------- shape and fields


def test_generate_response_shape(url):
    out = gen(url, sampling_params={"temperature": 1.0, "max_new_tokens": 5, "sampling_seed": 1}, return_logprob=True)
    assert set(out) >= {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert isinstance(meta["id"], str) and meta["id"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == len(PROMPT)
    assert meta["completion_tokens"] == len(out["output_ids"]) == 5
    assert meta["weight_version"] == "default"
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    assert all(isinstance(lp, float) and lp <= 0.0 and txt is None for lp, _, txt in lps)
    assert meta["input_token_logprobs"] == []  # logprob_start_len defaults to -1
    assert out["text"] == ""  # no tokenizer for the tiny random model


def test_no_logprob_fields_unless_requested(url):
    meta = gen(url, sampling_params={"max_new_tokens": 2})["meta_info"]
    assert "output_token_logprobs" not in meta and "input_token_logprobs" not in meta


def test_batch_matches_single_requests(url):
    prompts = [PROMPT, [1, 2, 3]]
    sp = {"temperature": 0.9, "max_new_tokens": 4, "sampling_seed": 11}
    batch = HTTP.post(
        f"{url}/generate", json={"input_ids": prompts, "sampling_params": sp, "return_logprob": True}, timeout=60
    ).json()
    assert isinstance(batch, list) and len(batch) == 2
    for prompt, item in zip(prompts, batch, strict=True):
        single = gen(url, input_ids=prompt, sampling_params=sp, return_logprob=True)
        assert item["output_ids"] == single["output_ids"]
        assert item["meta_info"]["output_token_logprobs"] == single["meta_info"]["output_token_logprobs"]
    assert batch[0]["meta_info"]["id"] != batch[1]["meta_info"]["id"]


def test_batch_per_item_sampling_params(url):
    sps = [{"temperature": 0, "max_new_tokens": 2}, {"temperature": 0, "max_new_tokens": 3}]
    batch = HTTP.post(f"{url}/generate", json={"input_ids": [PROMPT, PROMPT], "sampling_params": sps}).json()
    assert [len(b["output_ids"]) for b in batch] == [2, 3]
    assert batch[1]["output_ids"][:2] == batch[0]["output_ids"]


# ---------------------------------------------------------------- sampling


def test_seed_determinism(url):
    sp = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 8, "sampling_seed": 1234}
    a, b = gen(url, sampling_params=sp), gen(url, sampling_params=sp)
    c = gen(url, sampling_params={**sp, "sampling_seed": 4321})
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]


def test_greedy_matches_slow_reference(url, engine):
    out = gen(url, sampling_params={"temperature": 0.0, "max_new_tokens": 6}, return_logprob=True)
    assert out["output_ids"] == greedy_reference(engine.model, PROMPT, 6)
    # greedy reports temperature-1 log-probs (SGLang: temperature 0 -> T=1, top_k=1)
    expected = score_tokens(engine.model, PROMPT + out["output_ids"])[len(PROMPT) - 1 :]
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # top_k=1 and a vanishing top_p are greedy too
    assert gen(url, sampling_params={"top_k": 1, "max_new_tokens": 6, "sampling_seed": 5})["output_ids"] == out["output_ids"]
    assert gen(url, sampling_params={"top_p": 1e-9, "max_new_tokens": 6, "sampling_seed": 5})["output_ids"] == out["output_ids"]


@pytest.mark.parametrize(
    "sp",
    [
        {"temperature": 1.0},
        {"temperature": 0.7},
        {"temperature": 1.3, "top_p": 0.9, "top_k": 50},
    ],
)
def test_logprob_contract_matches_training_forward(url, engine, sp):
    """Engine-reported log-probs == log_softmax(full forward / T) of the same tokens (float32 tolerance)."""
    out = gen(url, sampling_params={**sp, "max_new_tokens": 10, "sampling_seed": 7}, return_logprob=True)
    tokens = PROMPT + out["output_ids"]
    expected = score_tokens(engine.model, tokens, temperature=sp["temperature"])[len(PROMPT) - 1 :]
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    assert got.shape == expected.shape == (10,)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_return_original_logprob_reports_temperature_one():
    engine = TorchEngine(return_original_logprob=True)
    out = engine.generate(
        {"input_ids": PROMPT, "sampling_params": {"temperature": 0.5, "max_new_tokens": 4, "sampling_seed": 2}, "return_logprob": True}
    )
    expected = score_tokens(engine.model, PROMPT + out["output_ids"], temperature=1.0)[len(PROMPT) - 1 :]
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_top_k_and_top_p_sets_match_slow_reference(url, engine):
    sp = {"temperature": 1.0, "top_p": 0.05, "top_k": 40, "max_new_tokens": 6, "sampling_seed": 3,
          "custom_params": {"return_top_p_token_ids": True}}
    out = gen(url, sampling_params=sp)
    meta = out["meta_info"]
    offsets, kept = meta["top_p_token_offsets"], meta["top_p_token_ids"]
    assert len(offsets) == len(out["output_ids"]) + 1 and offsets[0] == 0 and offsets[-1] == len(kept)
    ids = list(PROMPT)
    for step, token in enumerate(out["output_ids"]):
        probs = torch.softmax(full_logits(engine.model, ids)[-1], dim=-1)
        order = probs.argsort(descending=True).tolist()[:40]  # top-k
        expected, mass = [], 0.0
        for t in order:  # nucleus: keep while the mass before the token is <= top_p
            if mass > 0.05 + 1e-6:
                break
            expected.append(t)
            mass += float(probs[t])
        step_kept = kept[offsets[step] : offsets[step + 1]]
        assert set(step_kept) == set(expected)
        assert token in step_kept
        ids.append(token)


def test_stop_token_ids_and_no_stop_trim(url):
    greedy = gen(url, sampling_params={"temperature": 0, "max_new_tokens": 6})["output_ids"]
    stop = greedy[2]
    first = greedy.index(stop)
    out = gen(url, sampling_params={"temperature": 0, "max_new_tokens": 6, "stop_token_ids": [stop]}, return_logprob=True)
    assert out["output_ids"] == greedy[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert len(out["meta_info"]["output_token_logprobs"]) == first + 1


# ---------------------------------------------------------------- input log-probs (OPD teacher scoring)


def test_teacher_scoring_input_token_logprobs(url, engine):
    """OPD's payload: max_new_tokens=0, logprob_start_len=0 -> first entry None, rest = training forward."""
    out = gen(
        url,
        sampling_params={"temperature": 0.6, "max_new_tokens": 0, "skip_special_tokens": False},
        return_logprob=True,
        logprob_start_len=0,
    )
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["completion_tokens"] == 0
    assert meta["finish_reason"]["type"] == "length"
    entries = meta["input_token_logprobs"]
    assert [t for _, t, _ in entries] == PROMPT
    assert entries[0][0] is None
    expected = score_tokens(engine.model, PROMPT)  # SGLang's input log-probs are temperature-1
    torch.testing.assert_close(torch.tensor([e[0] for e in entries[1:]]), expected, atol=1e-5, rtol=1e-5)


def test_input_logprobs_with_start_len(url, engine):
    meta = gen(url, sampling_params={"max_new_tokens": 1}, return_logprob=True, logprob_start_len=3)["meta_info"]
    entries = meta["input_token_logprobs"]
    assert [t for _, t, _ in entries] == PROMPT[3:]
    assert entries[0][0] is None
    expected = score_tokens(engine.model, PROMPT)[3:]
    torch.testing.assert_close(torch.tensor([e[0] for e in entries[1:]]), expected, atol=1e-5, rtol=1e-5)


def test_teacher_scoring_input_top_logprobs(url, engine):
    """MOPD top-k teacher request (top_logprobs_num=k): SGLang 0.5.x's input_top_logprobs shape, None first,
    then per position the k largest raw log-probs of the distribution predicting it, [logprob, id, text]."""
    k = 4
    meta = gen(
        url,
        sampling_params={"temperature": 0.6, "max_new_tokens": 0, "skip_special_tokens": False},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=k,
    )["meta_info"]
    top = meta["input_top_logprobs"]
    assert len(top) == len(meta["input_token_logprobs"]) == len(PROMPT)
    assert top[0] is None and meta["output_top_logprobs"] == []
    expected = torch.log_softmax(full_logits(engine.model, PROMPT)[:-1], dim=-1)  # slow reference, no cache
    for pos, row in enumerate(top[1:]):
        assert len(row) == k and all(len(e) == 3 and e[2] is None for e in row)
        values = [e[0] for e in row]
        assert values == sorted(values, reverse=True)
        ref_values, ref_ids = expected[pos].topk(k)
        assert [e[1] for e in row] == ref_ids.tolist()
        torch.testing.assert_close(torch.tensor(values), ref_values, atol=1e-5, rtol=1e-5)
        # the sampled-token entry of the same position is read from the same distribution
        sampled = meta["input_token_logprobs"][pos + 1]
        assert sampled[0] == pytest.approx(float(expected[pos, sampled[1]]), abs=1e-5)
    # the opd plugin's parser reads exactly this shape
    from slime_ascend.algorithms.opd import topk_payload_from_sglang, unpack_topk_payload

    ids, lps = unpack_topk_payload(topk_payload_from_sglang(top, 3, k))
    assert ids.tolist() == [[e[1] for e in row] for row in top[-3:]]


def test_top_logprobs_with_start_len_and_generation(url, engine):
    meta = gen(url, sampling_params={"temperature": 0, "max_new_tokens": 3}, return_logprob=True,
               logprob_start_len=3, top_logprobs_num=2)["meta_info"]
    assert len(meta["input_top_logprobs"]) == len(PROMPT) - 3 and meta["input_top_logprobs"][0] is None
    out_top = meta["output_top_logprobs"]
    assert len(out_top) == len(meta["output_token_logprobs"]) == 3
    for row, (lp, tok, _) in zip(out_top, meta["output_token_logprobs"], strict=True):
        assert len(row) == 2 and row[0][1] == tok  # greedy: the chosen token is the top-1
        assert row[0][0] == pytest.approx(lp, abs=1e-6)
    # without return_logprob, or with top_logprobs_num 0, there are no top entries (as SGLang)
    plain = gen(url, sampling_params={"max_new_tokens": 1}, return_logprob=True, logprob_start_len=0)["meta_info"]
    assert "input_top_logprobs" not in plain and "output_top_logprobs" not in plain


# ---------------------------------------------------------------- weight updates


def test_update_weights_from_disk_changes_outputs_and_version(tmp_path):
    engine = TorchEngine(return_original_logprob=False)
    with engine.start_in_thread() as url:
        sp = {"temperature": 0, "max_new_tokens": 6}
        before = gen(url, sampling_params=sp)
        new_model = perturbed_copy(engine.model)
        v1 = save_model(new_model, tmp_path / "weight_v000001")
        r = HTTP.post(f"{url}/update_weights_from_disk", json={"model_path": str(v1), "weight_version": "7"})
        assert r.status_code == 200 and r.json()["success"] is True
        assert HTTP.get(f"{url}/get_weight_version").json() == {"weight_version": "7"}
        after = gen(url, sampling_params=sp, return_logprob=True)
        assert after["meta_info"]["weight_version"] == "7"
        assert after["output_ids"] != before["output_ids"]
        assert after["output_ids"] == greedy_reference(new_model, PROMPT, 6)
        expected = score_tokens(new_model, PROMPT + after["output_ids"])[len(PROMPT) - 1 :]
        got = torch.tensor([lp for lp, _, _ in after["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        # without weight_version a numeric version is bumped
        r = HTTP.post(f"{url}/update_weights_from_disk", json={"model_path": str(v1)})
        assert r.status_code == 200
        assert HTTP.get(f"{url}/get_weight_version").json()["weight_version"] == "8"
        info = HTTP.get(f"{url}/server_info").json()
        assert info["weight_version"] == "8" and info["model_path"] == str(v1)


def test_update_weights_rejects_other_architecture_and_keeps_model(tmp_path):
    engine = TorchEngine(return_original_logprob=False)
    with engine.start_in_thread() as url:
        before = gen(url, sampling_params={"temperature": 0, "max_new_tokens": 4})
        from transformers import AutoModelForCausalLM

        other = AutoModelForCausalLM.from_config(reference_model.tiny_qwen3_config(hidden_size=32, head_dim=8))
        bad_dir = save_model(other, tmp_path / "other")
        r = HTTP.post(f"{url}/update_weights_from_disk", json={"model_path": str(bad_dir), "weight_version": "2"})
        assert r.status_code == 400
        assert "architecture" in r.json()["error"] and "hidden_size" in r.json()["error"]
        for body in ({"model_path": str(tmp_path / "missing")}, {}, {"model_path": 5}):
            assert HTTP.post(f"{url}/update_weights_from_disk", json=body).status_code == 400
        (tmp_path / "pickled").mkdir()
        (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"not used")
        r = HTTP.post(f"{url}/update_weights_from_disk", json={"model_path": str(tmp_path / "pickled")})
        assert r.status_code == 400 and "safetensors" in r.json()["error"]
        assert HTTP.get(f"{url}/get_weight_version").json()["weight_version"] == "default"
        assert gen(url, sampling_params={"temperature": 0, "max_new_tokens": 4})["output_ids"] == before["output_ids"]


# ---------------------------------------------------------------- pause / abort


def _wait_running(url: str, n: int) -> None:
    for _ in range(20000):
        loads = HTTP.get(f"{url}/v1/loads?include=core").json()["loads"][0]
        if loads["num_running_reqs"] >= n:
            return
        time.sleep(0.002)
    raise AssertionError("request never started running")


LONG = {"input_ids": [1, 2], "sampling_params": {"temperature": 1.0, "max_new_tokens": 4000, "ignore_eos": True}, "return_logprob": True}


def test_pause_aborts_inflight_and_holds_new_requests():
    engine = TorchEngine(return_original_logprob=False)
    with engine.start_in_thread() as url:
        running, running_box = post_in_thread(url, LONG)
        _wait_running(url, 1)
        assert HTTP.post(f"{url}/pause_generation", json={}).status_code == 200
        running.join(timeout=120)
        out = running_box["response"]
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        n = out["meta_info"]["completion_tokens"]
        assert n < 4000 and len(out["output_ids"]) == len(out["meta_info"]["output_token_logprobs"]) == n

        waiting, waiting_box = post_in_thread(url, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}})
        waiting.join(timeout=0.5)
        assert waiting.is_alive() and "response" not in waiting_box  # held while paused
        assert HTTP.get(f"{url}/health_generate").status_code == 200  # health is not blocked by pause
        assert HTTP.post(f"{url}/continue_generation", json={}).status_code == 200
        waiting.join(timeout=120)
        assert waiting_box["response"]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_in_place_pause_parks_then_resumes(tmp_path):
    engine = TorchEngine(return_original_logprob=False)
    with engine.start_in_thread() as url:
        payload = {**LONG, "sampling_params": {**LONG["sampling_params"], "max_new_tokens": 800}}
        running, box = post_in_thread(url, payload)
        _wait_running(url, 1)
        assert HTTP.post(f"{url}/pause_generation", json={"mode": "in_place"}).status_code == 200
        running.join(timeout=0.5)
        assert running.is_alive()
        # a weight update goes through while paused (slime: pause -> flush -> update -> continue)
        v = save_model(perturbed_copy(engine.model), tmp_path / "v")
        assert HTTP.get(f"{url}/flush_cache").status_code == 200
        r = HTTP.post(f"{url}/update_weights_from_disk", json={"model_path": str(v), "weight_version": "3"})
        assert r.status_code == 200
        HTTP.post(f"{url}/continue_generation", json={})
        running.join(timeout=300)
        meta = box["response"]["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 800}
        assert meta["weight_version"] == "3"


def test_abort_request_all():
    engine = TorchEngine(return_original_logprob=False)
    with engine.start_in_thread() as url:
        running, box = post_in_thread(url, LONG)
        _wait_running(url, 1)
        assert HTTP.post(f"{url}/abort_request", json={"abort_all": True}).json()["num_aborted"] == 1
        running.join(timeout=120)
        assert box["response"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert HTTP.get(f"{url}/v1/loads").json()["loads"][0]["num_running_reqs"] == 0


# ---------------------------------------------------------------- malformed requests


BAD_GENERATE_BODIES = [
    b"{not json",
    b"[1, 2, 3]",
    b"\xff\xfe",
    b'"a string"',
    b"{}",
    b'{"input_ids": []}',
    b'{"input_ids": "abc"}',
    b'{"input_ids": [1, 2.5]}',
    b'{"input_ids": [1, true]}',
    b'{"input_ids": [1, -1]}',
    b'{"input_ids": [1, 1024]}',
    b'{"input_ids": [[1, 2], []]}',
    b'{"input_ids": [1], "text": "x"}',
    b'{"text": "hello"}',
    b'{"input_ids": [1], "sampling_params": [1]}',
    b'{"input_ids": [1], "sampling_params": "greedy"}',
    b'{"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}',
    b'{"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}}',
    b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1.5}}',
    b'{"input_ids": [1], "sampling_params": {"temperature": -0.5}}',
    b'{"input_ids": [1], "sampling_params": {"temperature": "hot"}}',
    b'{"input_ids": [1], "sampling_params": {"top_p": 0}}',
    b'{"input_ids": [1], "sampling_params": {"top_p": 1.5}}',
    b'{"input_ids": [1], "sampling_params": {"top_k": 0}}',
    b'{"input_ids": [1], "sampling_params": {"min_p": 2}}',
    b'{"input_ids": [1], "sampling_params": {"stop_token_ids": [5000]}}',
    b'{"input_ids": [1], "sampling_params": {"stop_token_ids": "5"}}',
    b'{"input_ids": [1], "sampling_params": {"stop": ["x"]}}',
    b'{"input_ids": [1], "sampling_params": {"stop": 3}}',
    b'{"input_ids": [1], "sampling_params": {"sampling_seed": "s"}}',
    b'{"input_ids": [1], "sampling_params": {"no_stop_trim": "yes"}}',
    b'{"input_ids": [1], "sampling_params": {"repetition_penalty": 1.2}}',
    b'{"input_ids": [1], "sampling_params": {"n": 2}}',
    b'{"input_ids": [1], "sampling_params": {"bogus": 1}}',
    b'{"input_ids": [1], "return_logprob": "yes"}',
    b'{"input_ids": [1], "return_logprob": true, "logprob_start_len": 5}',
    b'{"input_ids": [1], "return_logprob": true, "logprob_start_len": -2}',
    b'{"input_ids": [1], "stream": true}',
    b'{"input_ids": [1], "top_logprobs_num": -1}',
    b'{"input_ids": [1], "top_logprobs_num": 1000000}',
    b'{"input_ids": [1], "top_logprobs_num": "5"}',
    b'{"input_ids": [1], "image_data": ["x"]}',
    b'{"input_ids": [1], "unknown_field": 1}',
    b'{"input_ids": [1], "rid": 5}',
    b'{"input_ids": [[1], [2]], "sampling_params": [{}]}',
    b'{"input_ids": [1], "return_logprob": [true]}',
]


@pytest.mark.parametrize("body", BAD_GENERATE_BODIES)
def test_malformed_generate_is_4xx_with_message(url, body):
    r = HTTP.post(f"{url}/generate", content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
    assert isinstance(r.json()["error"], str) and r.json()["error"]


def test_other_endpoints_reject_bad_input_and_server_survives(url):
    assert HTTP.get(f"{url}/no_such_endpoint").status_code == 404
    assert HTTP.get(f"{url}/generate").status_code == 405
    assert HTTP.post(f"{url}/pause_generation", json={"mode": "sideways"}).status_code == 400
    assert HTTP.post(f"{url}/abort_request", json={"rid": 3}).status_code == 400
    assert HTTP.post(f"{url}/update_weights_from_disk", content=b"[]").status_code == 400
    # served (torch_engine/weight_group.py): a body without SGLang's fields is refused, naming them
    r = HTTP.post(f"{url}/update_weights_from_distributed", json={})
    assert r.status_code == 400 and "missing fields" in r.json()["error"], r.text
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)  # httpx refuses to send a bad header
    try:
        conn.putrequest("POST", "/generate")
        conn.putheader("Content-Length", "abc")
        conn.endheaders()
        assert conn.getresponse().status == 400
    finally:
        conn.close()
    assert HTTP.get(f"{url}/health").status_code == 200
    assert gen(url, sampling_params={"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1


# ---------------------------------------------------------------- info endpoints and binding


def test_info_endpoints(url):
    for path in ("/server_info", "/get_server_info"):
        info = HTTP.get(f"{url}{path}").json()
        assert info["tp_size"] == 1 and info["pp_size"] == 1 and info["weight_version"]
        assert info["enable_memory_saver"] is False  # checked by slime against --offload-rollout
    assert HTTP.get(f"{url}/get_model_info").json()["is_generation"] is True
    for path in ("/health", "/health_generate", "/flush_cache"):
        assert HTTP.get(f"{url}{path}").status_code == 200
    assert HTTP.post(f"{url}/flush_cache").status_code == 200


def test_binds_loopback_by_default(engine):
    server = make_server(engine, port=0)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.server_close()
    assert build_parser().parse_args([]).host == "127.0.0.1"
    with engine.start_in_thread() as base:
        assert base.startswith("http://127.0.0.1:")


# ---------------------------------------------------------------- tokenizer / text path


@pytest.fixture(scope="module")
def text_engine_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_with_tokenizer")
    return save_model(load_model(None, seed=3), out, reference_model.build_byte_tokenizer())


def test_text_prompt_and_stop_string(text_engine_dir):
    engine = TorchEngine(model_path=str(text_engine_dir))
    with engine.start_in_thread() as url:
        out = gen(url, input_ids=None, text="hello world", sampling_params={"temperature": 0, "max_new_tokens": 6}, return_logprob=True)
        assert out["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode("hello world", add_special_tokens=False))
        assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
        ids = out["output_ids"]
        stop_str = engine.tokenizer.decode([ids[1]])
        first = next(i for i, t in enumerate(ids) if stop_str in engine.tokenizer.decode(ids[: i + 1]))
        stopped = gen(url, input_ids=None, text="hello world", sampling_params={"temperature": 0, "max_new_tokens": 6, "stop": [stop_str]})
        assert stopped["output_ids"] == ids[: first + 1]
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
        assert stop_str not in stopped["text"]
        kept = gen(url, input_ids=None, text="hello world",
                   sampling_params={"temperature": 0, "max_new_tokens": 6, "stop": [stop_str], "no_stop_trim": True})
        assert kept["text"].endswith(stop_str)


# ---------------------------------------------------------------- model loading


def test_tiny_model_is_seeded_and_shaped():
    a, b, c = load_model(None, seed=0), load_model(None, seed=0), load_model(None, seed=1)
    cfg = a.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (1024, 64, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert torch.equal(score_tokens(a, PROMPT), score_tokens(b, PROMPT))
    assert not torch.equal(score_tokens(a, PROMPT), score_tokens(c, PROMPT))


def test_score_tokens_matches_loop_reference():
    model = load_model(None)
    got = score_tokens(model, PROMPT, temperature=0.8)
    expected = []
    for i in range(1, len(PROMPT)):  # prefix-by-prefix, one position at a time
        logits = full_logits(model, PROMPT[:i])[-1] / 0.8
        expected.append(float(logits[PROMPT[i]] - torch.logsumexp(logits, dim=-1)))
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_load_model_refuses_bin_only_dir(tmp_path):
    model_dir = save_model(load_model(None), tmp_path / "m")
    for f in model_dir.glob("*.safetensors"):
        f.unlink()
    (model_dir / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="safetensors"):
        load_model(str(model_dir))


def test_quantized_checkpoint_routes_through_quant_loader(tmp_path, monkeypatch):
    """A config.json quantization_config of our formats is dequantized by slime_ascend.quant.dequantize_stored
    from the tensors read once (read_checkpoint)."""
    import slime_ascend.quant as quant

    source = load_model(None, seed=5)
    model_dir = save_model(source, tmp_path / "q")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (model_dir / "config.json").write_text(json.dumps(config))
    calls = []

    def fake_dequantize(path, named, dtype):
        calls.append((path, sorted(named), dtype))
        return {k: v.clone() for k, v in source.state_dict().items()}

    monkeypatch.setattr(quant, "dequantize_stored", fake_dequantize, raising=False)
    loaded = load_model(str(model_dir), torch.float32)
    assert calls == [(str(model_dir), sorted(source.state_dict()), torch.float32)]
    torch.testing.assert_close(score_tokens(loaded, PROMPT), score_tokens(source, PROMPT))


def test_real_fp8_block_checkpoint_loads_close_to_source(tmp_path):
    """FP8 block checkpoint (e4m3 weights + float32 weight_scale_inv per 128x128 block) via the real quant loader."""
    source = load_model(None, seed=6)
    state = {}
    block = 128
    for name, w in source.state_dict().items():
        if name.endswith("proj.weight") and ".layers." in name:
            rows, cols = w.shape
            scale = torch.empty((rows + block - 1) // block, (cols + block - 1) // block)
            q = torch.empty_like(w, dtype=torch.float8_e4m3fn)
            for i in range(scale.shape[0]):
                for j in range(scale.shape[1]):
                    tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
                    s = tile.abs().max().clamp(min=1e-12) / 448.0
                    scale[i, j] = s
                    q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / s).to(torch.float8_e4m3fn)
            state[name] = q
            state[name.removesuffix("weight") + "weight_scale_inv"] = scale
        else:
            state[name] = w.clone()
    model_dir = tmp_path / "fp8"
    model_dir.mkdir()
    from safetensors.torch import save_file

    save_file(state, str(model_dir / "model.safetensors"))
    config = source.config.to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (model_dir / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(model_dir), torch.float32)
    for name, w in source.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], w, atol=float(w.abs().max()) / 8, rtol=0.0)
    torch.testing.assert_close(score_tokens(loaded, PROMPT), score_tokens(source, PROMPT), atol=0.05, rtol=0.0)


def test_concurrent_requests_match_sequential(url):
    """Interleaved decode steps of concurrent requests do not mix KV caches or generators."""
    payloads = [
        {"input_ids": PROMPT[: 2 + i], "sampling_params": {"temperature": 0.9, "max_new_tokens": 5, "sampling_seed": i}, "return_logprob": True}
        for i in range(4)
    ]
    sequential = [HTTP.post(f"{url}/generate", json=p, timeout=120).json() for p in payloads]
    threads = [post_in_thread(url, p) for p in payloads]
    for thread, _ in threads:
        thread.join(timeout=120)
    for (_, box), seq in zip(threads, sequential, strict=True):
        assert box["response"]["output_ids"] == seq["output_ids"]
        assert box["response"]["meta_info"]["output_token_logprobs"] == seq["meta_info"]["output_token_logprobs"]


@pytest.mark.parametrize("fmt", ["int8-w8a8", "fp8-block"])
def test_engine_reports_the_quantised_format_it_serves(tmp_path, fmt, caplog):
    """/server_info and /model_info carry SGLang's ``quantization`` field: the format of the checkpoint the
    engine loaded (at start and after each update_weights_from_disk), and each update is logged with its
    version, path and format."""
    from slime_ascend.quant.cli import main_quantize

    bf16 = save_model(load_model(None, seed=3), tmp_path / "bf16")
    qdir = tmp_path / fmt
    assert main_quantize([str(bf16), str(qdir), "--format", fmt]) == 0
    eng = TorchEngine(model_path=str(bf16))
    assert eng.server_info()["quantization"] is None and eng.model_info()["quantization"] is None
    with caplog.at_level("INFO", logger="slime_ascend.rollout.engine"):
        eng.update_weights_from_disk(str(qdir), weight_version="7")
    assert eng.server_info()["quantization"] == fmt and eng.model_info()["quantization"] == fmt
    assert f"loaded weight version 7 from {qdir} ({fmt})" in caplog.text
    assert TorchEngine(model_path=str(qdir)).model_info()["quantization"] == fmt
    with caplog.at_level("INFO", logger="slime_ascend.rollout.engine"):
        eng.update_weights_from_disk(str(bf16))
    assert eng.model_info()["quantization"] is None and eng.weight_version == "8"
    assert f"loaded weight version 8 from {bf16} (unquantised)" in caplog.text

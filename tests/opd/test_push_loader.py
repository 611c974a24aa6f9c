"""Teacher switching by pushed weights: over the engine's weight-update group (``ascend_opd_switch_transport:
distributed``, slime's rank layout) or as shared-memory handles (``tensor``, slime's colocated push): the pool
stages the next teacher in host memory and the switch pushes it to a real torch engine (another process), which
then serves that teacher's weights exactly."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from slime_ascend.demo.slime_job import make_model, start_engine, stop
from slime_ascend.opd.pool import TeacherLoadError, TeacherPool
from slime_ascend.opd.push_loader import DistributedPushLoader, TensorPushLoader, buckets
from slime_ascend.opd.safetensors_dir import read_safetensors_dir
from slime_ascend.opd.teachers import parse_teachers
from slime_ascend.rollout.torch_engine.model import load_model, score_tokens

TOKENS = [5, 17, 99, 3, 250, 64, 7, 18]


def _post(url, payload):
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _served_log_probs(url: str) -> torch.Tensor:
    out = _post(url + "/generate", {"input_ids": TOKENS, "sampling_params": {"temperature": 1.0, "max_new_tokens": 0},
                                    "return_logprob": True, "logprob_start_len": 0})
    return torch.tensor([entry[0] for entry in out["meta_info"]["input_token_logprobs"][1:]])


def _version(url: str) -> str:
    with urllib.request.urlopen(url + "/get_weight_version", timeout=30) as resp:
        return json.loads(resp.read())["weight_version"]


def test_buckets_keep_order_and_size():
    state = {n: torch.zeros(k, dtype=torch.float32) for n, k in (("a", 10), ("b", 10), ("c", 30), ("d", 1))}
    assert buckets(state, 80) == [["a", "b"], ["c"], ["d"]]  # c (120 bytes) alone, d after it
    assert buckets(state, 10_000) == [["a", "b", "c", "d"]]
    assert [n for b in buckets(state, 1) for n in b] == list(state)


def test_only_the_torch_engine_is_sent_donate_tensors(tmp_path):
    """The staged teacher is handed over (``donate_tensors``) to engines whose server info says they take it (the
    torch engine); an SGLang engine (no such field) gets SGLang's request, without it."""
    teacher = make_model(tmp_path / "math", seed=1)
    sent = []

    def post(url, payload, timeout_s):
        if url.endswith("/get_server_info"):
            return {"tp_size": 1, **({"donate_tensors": True} if "torch" in url else {})}
        sent.append((url, sorted(payload)))
        return {"success": True, "message": "ok"}

    loader = TensorPushLoader(["http://torch:1", "http://sglang:2"], post=post)
    spec = parse_teachers([{"name": "math", "checkpoint_dir": str(teacher), "domains": ["math"]}])[0]
    loader.activate(spec, loader.stage(spec))
    base = ["flush_cache", "serialized_named_tensors", "weight_version"]
    assert sorted(sent) == [("http://sglang:2/update_weights_from_tensor", base),
                            ("http://torch:1/update_weights_from_tensor", sorted([*base, "donate_tensors"]))]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["distributed", "tensor"])
def test_switches_push_each_teacher_into_the_engine_from_host_memory(tmp_path, transport):
    student = make_model(tmp_path / "student", seed=0)
    teachers = {name: make_model(tmp_path / name, seed=seed) for name, seed in (("math", 1), ("code", 2))}
    other_shape = make_model(tmp_path / "wide", seed=3, config_overrides={"intermediate_size": 96})
    engine = start_engine(student, tmp_path / "engine.log")
    try:
        loader_class = {"distributed": DistributedPushLoader, "tensor": TensorPushLoader}[transport]
        loader = loader_class(engine.url, bucket_bytes=64 << 10)  # several buckets a teacher
        specs = [{"name": n, "checkpoint_dir": str(d), "domains": [n]} for n, d in teachers.items()]
        specs.append({"name": "wide", "checkpoint_dir": str(other_shape), "domains": ["wide"]})
        one_teacher = read_safetensors_dir(teachers["math"])[1]
        with TeacherPool(specs, loader) as pool:
            pool.set_schedule(["math", "code", "math"])  # stages math now, in the background
            for n, name in enumerate(["math", "code", "math"], start=1):
                info = pool.activate(name)
                assert info.switched and info.prefetch in ("hit", "late"), info  # staged while "scoring"
                assert _version(engine.url) == f"opd:{name}:{n}"
                expected = score_tokens(load_model(teachers[name]), TOKENS)
                assert torch.allclose(_served_log_probs(engine.url), expected, atol=1e-5), name
            m = pool.metrics()
            assert m["switches"] == 3 and m["cold_loads"] == 0 and m["read_bytes"] == 3 * one_teacher
            # host memory: the engine holds the resident teacher; the pool at most the one staged copy
            assert m["peak_host_bytes"] <= one_teacher, m
            assert loader.pushed_bytes == 3 * one_teacher
            # a teacher of other shapes: the engine refuses the pushed version, keeps serving the last good one
            with pytest.raises(TeacherLoadError, match="activation failed"):
                pool.activate("wide")
            assert pool.state()["wide"]["status"] == "failed"
            assert _version(engine.url) == "opd:math:3"
            assert torch.allclose(_served_log_probs(engine.url), score_tokens(load_model(teachers["math"]), TOKENS),
                                  atol=1e-5)
        log = engine.log.read_text()
        if transport == "distributed":
            assert "switched to weight version opd:code:2 from" in log
        else:  # the staged teacher sits in shared memory, so the push hands the engine handles, not bytes
            assert "loaded weight version opd:code:2 from" in log and "update_weights_from_tensor" in log
            # handed over: the engine keeps what it received as its weights instead of copying it into them (these
            # teachers are bf16 on disk and the engine fp32: it adopts its own conversion; for an fp32 teacher the
            # staged shared memory itself, test_torch_engine_tensor_update.py)
            assert f"; donated: {2 * one_teacher} bytes adopted as the model's weights, not copied" in log
            staged = loader.stage(parse_teachers(specs[:1])[0])
            assert staged.payload and all(t.is_shared() for t in staged.payload.values())
    finally:
        stop(engine.proc)

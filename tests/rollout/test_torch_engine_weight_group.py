"""The torch engine's ``/init_weights_update_group``, ``/update_weights_from_distributed`` and
``/destroy_weights_update_group`` (torch_engine/weight_group.py), with a real second process as the sender over
gloo (tests/rollout/weight_sender.py, slime's order of calls): bucketed pushes switch atomically, a broadcast
that breaks off (sender killed mid-bucket, a bucket missing, tensors that never come) leaves the old version
serving and the next push working, refused pushes change nothing, quantised pushes carry the offline
converter's bytes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from slime_ascend.rollout.torch_engine.engine import TorchEngine
from torch_engine_fixtures import bf16_dir

SENDER = Path(__file__).with_name("weight_sender.py")
HTTP = httpx.Client(trust_env=False, timeout=60)
PROMPT = [1, 17, 250, 3, 999, 42]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def send(tmp_path: Path, url: str, tensors: dict[str, torch.Tensor], version, buckets: int = 3,
         timeout: float = 120, **plan) -> tuple[int, list[dict]]:
    """Run the sender process; (its exit code, the engine's answers it printed)."""
    names = sorted(tensors)
    path = tmp_path / f"push-{version}-{time.monotonic_ns()}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    size = -(-len(names) // buckets)
    plan = {"url": url, "port": free_port(), "group_name": "slime-pp_0", "tensors": str(path), "version": version,
            "buckets": [names[i:i + size] for i in range(0, len(names), size)], **plan}
    plan_file = path.with_suffix(".json")
    plan_file.write_text(json.dumps(plan))
    proc = subprocess.run([sys.executable, str(SENDER), str(plan_file)], capture_output=True, text=True,
                          timeout=timeout)
    answers = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, answers


def served(url: str) -> str:
    return HTTP.get(url + "/get_weight_version").json()["weight_version"]


def greedy(url: str) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    return HTTP.post(url + "/generate", json=body).json()["output_ids"]


def nudged(engine: TorchEngine, scale: float, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """The engine's weights, each moved by ``scale`` x a fixed pattern (the push of a trained version)."""
    gen = torch.Generator().manual_seed(int(scale * 1000))
    return {k: (v + scale * torch.randn(v.shape, generator=gen)).to(dtype)
            for k, v in engine.model.state_dict().items()}


def assert_serves(engine: TorchEngine, pushed: dict[str, torch.Tensor]) -> None:
    own = engine.model.state_dict()
    for name, tensor in pushed.items():
        assert torch.equal(own[name], tensor.to(own[name].dtype)), name


@pytest.fixture
def served_engine():
    engine = TorchEngine(return_original_logprob=False)
    engine.configure_weight_group(timeout_s=5)
    with engine.start_in_thread() as url:
        yield engine, url
    engine.weight_group.close()  # a group's name is registered once per process


def test_bucketed_push_serves_only_when_complete(served_engine, tmp_path):
    engine, url = served_engine
    before = greedy(url)
    first = nudged(engine, 0.5)
    # two of the three buckets of version 1, then the sender leaves: version 1 must not serve
    code, answers = send(tmp_path, url, first, 1, stop_after=2)
    assert code == 0 and [a["status"] for a in answers] == [200, 200, 200], answers
    assert "to come" in answers[-1]["body"]["message"]
    assert served(url) == "default" and greedy(url) == before
    # the next push (a new group under the same name, as slime reconnects) serves, whole
    second = nudged(engine, 0.7)
    code, answers = send(tmp_path, url, second, 2)
    assert code == 0 and all(a["status"] == 200 for a in answers), answers
    assert "complete" in answers[-1]["body"]["message"] and "and serving" in answers[-1]["body"]["message"]
    assert served(url) == "2"
    assert_serves(engine, second)
    assert greedy(url) != before
    info = HTTP.post(url + "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}).json()
    assert info["meta_info"]["weight_version"] == "2"
    # the same version again is refused (a push needs a new version), and the group can be destroyed
    code, answers = send(tmp_path, url, second, 2)
    assert answers[-1]["status"] == 400 and "already serving" in answers[-1]["body"]["error"], answers
    assert served(url) == "2"


def test_killed_sender_mid_broadcast_leaves_old_version_serving(served_engine, tmp_path):
    engine, url = served_engine
    before, weights = greedy(url), {k: v.clone() for k, v in engine.model.state_dict().items()}
    pushed = nudged(engine, 0.5)
    start = time.monotonic()
    code, answers = send(tmp_path, url, pushed, 1, kill_in_bucket=1, kill_after=2)
    assert code == -9, (code, answers)  # SIGKILL inside the second bucket's broadcast
    assert time.monotonic() - start < 60
    # the engine's answer to the broken bucket went to a dead client; it is serving the old weights
    deadline = time.monotonic() + 30
    while engine.weight_group._staged is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert engine.weight_group._staged is None  # the broken version was dropped
    assert served(url) == "default" and greedy(url) == before
    assert all(torch.equal(weights[k], v) for k, v in engine.model.state_dict().items())
    # and the next push works
    code, answers = send(tmp_path, url, pushed, 1)
    assert code == 0 and all(a["status"] == 200 for a in answers), answers
    assert served(url) == "1"
    assert_serves(engine, pushed)


def test_tensors_that_never_come_time_out(served_engine, tmp_path):
    engine, url = served_engine
    before = greedy(url)
    start = time.monotonic()
    code, answers = send(tmp_path, url, nudged(engine, 0.5), 1, stall_in_bucket=1)
    waited = time.monotonic() - start
    assert answers[-1]["status"] == 503, answers
    assert "broke off" in answers[-1]["body"]["error"] and "default keeps serving" in answers[-1]["body"]["error"]
    assert waited < 60  # bounded by the receiver's timeout (5 s here)
    assert served(url) == "default" and greedy(url) == before
    code, answers = send(tmp_path, url, nudged(engine, 0.6), 3)
    assert all(a["status"] == 200 for a in answers), answers
    assert served(url) == "3"


def test_refused_pushes_change_nothing(served_engine, tmp_path):
    engine, url = served_engine
    before = greedy(url)
    bad = nudged(engine, 0.5)
    bad["model.norm.weight"] = torch.full_like(bad["model.norm.weight"], float("nan"))
    code, answers = send(tmp_path, url, bad, 1)
    assert answers[-1]["status"] == 400 and "non-finite" in answers[-1]["body"]["error"], answers
    assert served(url) == "default" and greedy(url) == before
    extra = nudged(engine, 0.5)
    extra["model.not_a_weight"] = torch.zeros(3)
    code, answers = send(tmp_path, url, extra, 1, buckets=1)
    assert answers[-1]["status"] == 400 and "not in the served checkpoint" in answers[-1]["body"]["error"], answers
    resp = HTTP.post(url + "/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
        "group_name": "slime-pp_0", "backend": "nccl"})
    assert resp.status_code == 400 and "gloo groups only" in resp.json()["error"], resp.text
    assert served(url) == "default" and greedy(url) == before
    # malformed requests: one-line refusals, no group touched
    resp = HTTP.post(url + "/update_weights_from_distributed", json={"names": ["x"], "dtypes": ["float32"],
                                                                     "shapes": [[1]], "group_name": "nope"})
    assert resp.status_code == 400 and "init_weights_update_group first" in resp.json()["error"]
    resp = HTTP.post(url + "/init_weights_update_group", json={"master_address": "127.0.0.1"})
    assert resp.status_code == 400 and "missing fields" in resp.json()["error"]
    resp = HTTP.post(url + "/destroy_weights_update_group", json={"group_name": "nope"})
    assert resp.status_code == 400


@pytest.mark.parametrize("fmt", ["fp8-block", "int8-w8a8"])
def test_quantised_push_carries_the_converters_bytes(tmp_path, fmt):
    from slime_ascend.quant.checkpoint import convert_checkpoint

    def quantised(src: Path, out: Path) -> dict[str, torch.Tensor]:
        convert_checkpoint(src, out, fmt)
        return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    quantised(bf16_dir(tmp_path / "bf16-0", 0.0), tmp_path / "q0")
    pushed = quantised(bf16_dir(tmp_path / "bf16-1", 0.01), tmp_path / "q1")
    engine = TorchEngine(model_path=str(tmp_path / "q0"), return_original_logprob=False)
    engine.configure_weight_group(timeout_s=10, keep_dir=str(tmp_path / "kept"))
    with engine.start_in_thread() as url:
        # sent by the train side's own function (slime's, as train.gloo_float8_broadcast replaces it)
        code, answers = send(tmp_path, url, pushed, 1, via_train_patch=True)
        assert code == 0 and len(answers) == 4 and all(a["status"] == 200 for a in answers), answers
        assert served(url) == "1"
        # and holds it: SGLang's /get_weights_by_name with the exact bytes (weight_read.py) answers every tensor
        from slime_ascend.rollout.torch_engine.weight_read import decode_raw

        for name, tensor in pushed.items():
            answer = HTTP.post(url + "/get_weights_by_name",
                               json={"name": name, "truncate_size": 1 << 20, "return_raw": True}).json()
            assert answer["weight_version"] == "1" and answer["dtype"] == str(tensor.dtype).removeprefix("torch.")
            assert torch.equal(decode_raw(answer).view(torch.uint8), tensor.contiguous().view(torch.uint8)), name
    engine.weight_group.close()
    # what the engine received is the converter's output, byte for byte (float8 included: bytes on gloo)
    kept = load_file(str(tmp_path / "kept" / "weight_v000001" / "model.safetensors"))
    assert sorted(kept) == sorted(pushed)
    for name, tensor in pushed.items():
        assert kept[name].dtype == tensor.dtype and torch.equal(kept[name].view(torch.uint8),
                                                                tensor.contiguous().view(torch.uint8)), name
    # and it serves what loading that checkpoint from disk serves
    from_disk = TorchEngine(model_path=str(tmp_path / "q1"), return_original_logprob=False)
    want = from_disk.model.state_dict()
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, want[name]), name


DELTA_SENDER = Path(__file__).with_name("delta_weight_sender.py")


def _quantised(tmp_path: Path, step: float, name: str, moved: float = 0.0, fmt: str = "fp8-block"
               ) -> dict[str, torch.Tensor]:
    """The tiny model shifted by ``step``, then a fraction ``moved`` of its values moved by 5% (a small training
    step), converted offline to ``tmp_path / name``."""
    from slime_ascend.quant.checkpoint import convert_checkpoint

    src = bf16_dir(tmp_path / f"bf16-{name}", step)
    gen = torch.Generator().manual_seed(len(name) + int(moved * 1000))
    for f in sorted(src.glob("*.safetensors")):
        weights = load_file(str(f))
        for k, t in weights.items():
            x = t.float()
            weights[k] = (x + (torch.rand(x.shape, generator=gen) < moved) * x * 0.05).to(t.dtype)
        save_file(weights, str(f))
    out = tmp_path / name
    convert_checkpoint(src, out, fmt)
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _run_delta_sender(tmp_path: Path, url: str, pushes: list[dict]) -> list[dict]:
    """The delta sender's printed lines (each call's answer, each push's densities)."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"url": url, "port": free_port(), "group_name": "slime-pp_0", "pushes": pushes}))
    proc = subprocess.run([sys.executable, str(DELTA_SENDER), str(plan)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _calls(lines: list[dict]) -> list[tuple]:
    """(version, load_format without its base digest, status, success, serving) of each call."""
    return [(c["version"], c["load_format"] and c["load_format"].rpartition(":")[0], c["status"],
             c["body"].get("success"), c["body"].get("serving")) for c in lines if "status" in c]


def test_quantised_delta_push_equals_the_full_push(tmp_path):
    """Item 8: after a full push, the next version goes as the changed fp8 blocks only (with their scales), is
    staged and switched to like a full push and holds the converter's bytes; a delta against a version the engine
    does not serve is refused and the sender pushes that version whole."""
    from slime_ascend.weight_sync.distributed_delta import tensor_digest, version_digest

    def quantised(step: float, name: str, moved: float = 0.0) -> dict[str, torch.Tensor]:
        return _quantised(tmp_path, step, name, moved)

    quantised(0.0, "q0")
    versions = {v: quantised(0.01, f"q{v}", moved) for v, moved in ((1, 0.0), (2, 0.002), (3, 0.004))}
    engine = TorchEngine(model_path=str(tmp_path / "q0"), return_original_logprob=False)
    engine.configure_weight_group(timeout_s=10, keep_dir=str(tmp_path / "kept"))
    names = sorted(versions[1])
    size = -(-len(names) // 3)
    buckets = [names[i:i + size] for i in range(0, len(names), size)]
    pushes = []
    for v, tensors in versions.items():
        path = tmp_path / f"push{v}.safetensors"
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(path))
        pushes.append({"version": v, "tensors": str(path), "buckets": buckets, "held_as": "7" if v == 3 else None})
    with engine.start_in_thread() as url:
        lines = _run_delta_sender(tmp_path, url, pushes)
        calls = _calls(lines)
        delta = "slime_ascend.quant_delta:32:"
        assert calls == (
            [("1", None, 200, True, False)] * 2 + [("1", None, 200, True, True)]  # nothing held: whole
            + [("2", delta + "1", 200, True, False)] * 2 + [("2", delta + "1", 200, True, True)]  # the blocks only
            # v3 against a base the engine does not serve: refused, then the version whole
            + [("3", delta + "7", 200, False, False)] + [("3", None, 200, True, False)] * 2
            + [("3", None, 200, True, True)]), calls
        refused = next(c["body"] for c in lines if c.get("body", {}).get("success") is False)
        assert refused["delta_refused"] and "serves weight version 2, not the delta's base 7" in refused["message"]
        # each delta carried the digest of its base: version 1 as pushed
        digest = version_digest({k: tensor_digest(t) for k, t in versions[1].items()})
        assert {c["load_format"].rpartition(":")[2] for c in lines if c.get("version") == "2"} == {digest}
        densities = {c["version"]: c["density"] for c in lines if "density" in c}
        assert densities[1] == [None] * 3 and densities[3] == [None] * 3
        # 0.2% of the values moved: each bucket of version 2 carries a few % of its full push's bytes (measured
        # 0.040, 0.040, 0.059 with the block indices)
        assert all(0 < d < 0.2 for d in densities[2]), densities
        assert served(url) == "3"
    engine.weight_group.close()
    for v, pushed in versions.items():  # every version held the converter's bytes, delta or whole
        kept = load_file(str(tmp_path / "kept" / f"weight_v{v:06d}" / "model.safetensors"))
        assert sorted(kept) == sorted(pushed)
        for name, tensor in pushed.items():
            assert kept[name].dtype == tensor.dtype and torch.equal(kept[name].view(torch.uint8),
                                                                    tensor.contiguous().view(torch.uint8)), (v, name)
    assert any(not torch.equal(versions[2][k], versions[1][k]) for k in versions[1])  # the delta was not empty
    # and it serves what loading the last version from disk serves
    want = TorchEngine(model_path=str(tmp_path / "q3"), return_original_logprob=False).model.state_dict()
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, want[name]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e5m2,
                                   torch.float8_e4m3fn])
def test_all_finite_agrees_with_isfinite(dtype):
    """The engine's NaN/inf check of every weight it loads (one aminmax pass, model.all_finite; float8 through a
    float copy) refuses exactly what ``isfinite(t).all()`` refuses: a NaN, +inf or -inf anywhere (first, last,
    random places, strided views; float8_e4m3fn has no inf)."""
    from slime_ascend.rollout.torch_engine.model import all_finite
    from slime_ascend.rollout.torch_engine import model, weight_group

    def reference(t: torch.Tensor) -> bool:
        return bool(torch.isfinite(t.float()).all())

    assert weight_group.refuse_non_finite is model.refuse_non_finite  # a pushed version: the same check
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4099, generator=gen) * 0.02).to(dtype)
    assert all_finite(x) and all_finite(x[:0]) and all_finite(torch.full((7,), torch.finfo(dtype).max, dtype=dtype))
    places = [0, 4098, *torch.randint(0, 4099, (20,), generator=gen).tolist()]
    bads = (float("nan"),) if dtype == torch.float8_e4m3fn else (float("nan"), float("inf"), -float("inf"))
    for bad in bads:
        for at in places:
            y = x.clone()
            y[at] = bad
            assert all_finite(y) is False and not reference(y), (bad, at)
            view = y.view(-1)[: 4096].view(64, 64).t()[:, ::2]  # strided
            assert all_finite(view) == reference(view), (bad, at)


def test_weight_group_timeout_zero_or_negative_is_refused_in_one_line(capsys):
    """``serve-torch --weight-group-timeout 0`` became 120 s without a word (``timeout_s or DEFAULT``)."""
    from slime_ascend.rollout.torch_engine.cli import build_parser, serve_torch

    assert build_parser().parse_args(["--weight-group-timeout", "2.5"]).weight_group_timeout == 2.5
    for bad in ("0", "-3", "nan", "inf"):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(["--weight-group-timeout", bad])
        assert info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert "--weight-group-timeout" in err and "expected a positive number of seconds" in err, err
        assert len(err.splitlines()) == 1, err
    with pytest.raises(SystemExit):  # refused before anything listens or loads
        serve_torch(["--weight-group-timeout", "0", "--port", "0"])
    engine = TorchEngine()
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        engine.configure_weight_group(timeout_s=0)
    engine.configure_weight_group()
    assert engine.weight_group.timeout_s == 120.0


def test_init_group_to_an_unreachable_master_answers_within_its_timeout():
    """Before the fix torch's store client tried twice, each try the whole timeout, plus a back-off: 3 s became
    about 8 s (120 s became 254 s). One deadline now covers the whole join."""
    engine = TorchEngine()
    engine.configure_weight_group(timeout_s=3)
    port = free_port()  # closed: nothing listens there
    with engine.start_in_thread() as url:
        start = time.monotonic()
        resp = HTTP.post(url + "/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "unreachable", "backend": "gloo"})
        took = time.monotonic() - start
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert f"127.0.0.1:{port}" in error and "within 3s" in error and "\n" not in error, error
    assert 2.9 <= took < 4.0, took  # the old code: 4.8 to 7.8 s here


def test_a_delta_against_other_bytes_under_the_acknowledged_label_is_refused_and_sent_whole(tmp_path):
    """The engine serves version 1, but not the version 1 the sender acknowledged (restarted from another checkpoint
    under that label): the delta's base digest differs, the engine refuses it in one line, and the sender pushes the
    version whole. Before the fix the delta applied: version 2 served wrong tensors, with no error."""
    served_1 = _quantised(tmp_path, 0.0, "q0")  # what the engine holds as version 1
    held_1 = _quantised(tmp_path, 0.01, "q1")  # what the sender acknowledged as version 1
    pushed_2 = _quantised(tmp_path, 0.01, "q2", 0.002)  # a small step from the sender's version 1
    assert any(not torch.equal(served_1[k].view(torch.uint8), held_1[k].view(torch.uint8)) for k in held_1)
    engine = TorchEngine(model_path=str(tmp_path / "q0"), return_original_logprob=False, weight_version="1")
    engine.configure_weight_group(timeout_s=10)
    names = sorted(pushed_2)
    size = -(-len(names) // 3)
    paths = {}
    for name, tensors in (("held1", held_1), ("push2", pushed_2)):
        paths[name] = tmp_path / f"{name}.safetensors"
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(paths[name]))
    push = {"version": 2, "tensors": str(paths["push2"]),
            "buckets": [names[i:i + size] for i in range(0, len(names), size)],
            "held_from": {"version": "1", "tensors": str(paths["held1"])}}
    with engine.start_in_thread() as url:
        lines = _run_delta_sender(tmp_path, url, [push])
        delta = "slime_ascend.quant_delta:32:1"
        assert _calls(lines) == ([("2", delta, 200, False, False)] + [("2", None, 200, True, False)] * 2
                                 + [("2", None, 200, True, True)]), lines
        refused = next(c["body"] for c in lines if c.get("body", {}).get("success") is False)
        assert refused["delta_refused"] and "\n" not in refused["message"]
        assert "other bytes under weight version 1 than the sender acknowledged" in refused["message"], refused
        assert served(url) == "2"
    engine.weight_group.close()
    for name, tensor in pushed_2.items():  # the version pushed whole: the converter's bytes
        assert torch.equal(engine._served_checkpoint[name].view(torch.uint8), tensor.view(torch.uint8)), name

"""The torch engine on a device (``serve-torch --device``, torch_engine/device.py): on the emulated Ascend device
(``SLIME_ASCEND_EMULATE_NPU=1``, :mod:`slime_ascend.npu_emulation`, installed only in a subprocess: torch's
PrivateUse1 backend can be named once per process) the weights, the KV cache and the forwards live on ``npu:0``,
and every answer has the host engine's tokens for the same request, greedy and seeded sampling (the logits are
sampled on the host with the request's seeded generator), its log-probs within 2e-6 (the emulated device's operators
sum some float32 in another order: 4.8e-7 seen); a weight update from disk lands on the device; release frees the device's memory
and resume brings the same answers back; ``/get_weights_by_name`` answers from the device's weights. A device
that does not exist here is refused in one line naming the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from slime_ascend.rollout.engine_device import check_name
from slime_ascend.rollout.torch_engine.engine import TorchEngine
from torch_engine_fixtures import bf16_dir

REPO = Path(__file__).resolve().parents[2]
PROMPT = [1, 17, 250, 3, 999, 42]
REQUESTS = [  # greedy with input log-probs and top-k, and seeded sampling
    {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3,
     "sampling_params": {"max_new_tokens": 5, "temperature": 0}},
    {"input_ids": PROMPT, "return_logprob": True,
     "sampling_params": {"max_new_tokens": 6, "temperature": 0.8, "top_p": 0.9, "sampling_seed": 7}},
]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SLIME_ASCEND_PLUGINS", "SLIME_ASCEND_EMULATE_NPU")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")] if p)
    env.update(extra)
    return env


LOGPROB_ATOL = 2e-6


def _assert_alike(got, want, path="answer"):
    """Same structure, ids and texts; floats within LOGPROB_ATOL."""
    if isinstance(want, float):
        assert isinstance(got, float) and abs(got - want) <= LOGPROB_ATOL, (path, got, want)
    elif isinstance(want, list | dict):
        assert type(got) is type(want) and len(got) == len(want), (path, got, want)
        items = want.items() if isinstance(want, dict) else enumerate(want)
        for key, value in items:
            _assert_alike(got[key], value, f"{path}[{key!r}]")
    else:
        assert got == want, (path, got, want)


def _answers(engine: TorchEngine) -> list[dict]:
    out = []
    for request in REQUESTS:
        meta = engine.generate(json.loads(json.dumps(request)))
        out.append({"output_ids": meta["output_ids"],
                    **{k: v for k, v in meta["meta_info"].items() if k.endswith("logprobs")}})
    return out


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:1", "npu", "npu:7", " npu "])
def test_device_names_the_engine_knows(name):
    assert check_name(name) == name.strip()


@pytest.mark.parametrize("name", ["tpu", "npu:", "npu:x", "gpu:0", "", "cpu:0:1"])
def test_other_device_names_are_refused_naming_the_forms(name):
    with pytest.raises(ValueError, match="use cpu, cuda, cuda:N, npu or npu:N"):
        check_name(name)


def test_serve_torch_refuses_a_device_this_host_lacks_in_one_line():
    """No torch_npu here (and no emulation asked for): refused before listening, one line with the fix; a device name
    it does not know is argparse's usage error naming --device."""
    base = [sys.executable, "-m", "slime_ascend.cli", "serve-torch", "--port", "0"]
    out = subprocess.run(base + ["--device", "npu"], capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "torch_npu is not importable" in lines[0] and "SLIME_ASCEND_EMULATE_NPU=1" in lines[0], \
        out.stderr
    assert "Traceback" not in out.stderr
    out = subprocess.run(base + ["--device", "tpu"], capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 2 and "--device" in out.stderr and "use cpu, cuda" in out.stderr, out.stderr
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"torch.cuda.is_available\(\) is False .* Fix: serve with --device cpu"):
            TorchEngine(device="cuda")


# Run in a subprocess with the emulation installed: the engine on npu and the same engine on the host.
_ON_NPU = textwrap.dedent("""
    import json, sys
    from slime_ascend.npu_emulation import arm_from_environment
    arm_from_environment()  # SLIME_ASCEND_EMULATE_NPU=1, as every slime-ascend command arms it
    import torch
    from slime_ascend.rollout.torch_engine.engine import TorchEngine
    requests, version_dir = json.loads(sys.argv[1]), sys.argv[2]

    def weights(engine, name):
        held = engine.get_weights_by_name({"name": name, "truncate_size": 2})
        held.release()
        return held.value

    def answers(engine):
        out = []
        for request in requests:
            meta = engine.generate(json.loads(json.dumps(request)))
            out.append({"output_ids": meta["output_ids"],
                        **{k: v for k, v in meta["meta_info"].items() if k.endswith("logprobs")}})
        return out

    engine = TorchEngine(device="npu", return_original_logprob=False)
    report = {"server_device": engine.server_info()["device"],
              "param_devices": sorted({str(p.device) for p in engine.model.parameters()}),
              "buffer_devices": sorted({str(b.device) for b in engine.model.buffers()}),
              "torch_npu": sys.modules["torch_npu"].__version__, "healthy": engine.health_generate(),
              "before": answers(engine)}
    name = "model.layers.0.self_attn.q_proj.weight"
    report["weights_before"] = weights(engine, name)
    engine.update_weights_from_disk(version_dir, weight_version="v1")
    report["param_devices_after_update"] = sorted({str(p.device) for p in engine.model.parameters()})
    report["weights_after"] = weights(engine, name)
    report["updated"] = answers(engine)
    report["released"] = {k: v for k, v in engine.release_memory_occupation().items() if k.startswith("device")}
    report["healthy_released"] = engine.health_generate()
    engine.resume_memory_occupation()
    report["param_devices_after_resume"] = sorted({str(p.device) for p in engine.model.parameters()})
    report["resumed"] = answers(engine)
    print("REPORT " + json.dumps(report))
""")


def _weights(engine: TorchEngine, name: str):
    """``/get_weights_by_name``'s first two rows of ``name``, as the HTTP layer sends them."""
    held = engine.get_weights_by_name({"name": name, "truncate_size": 2})
    held.release()
    return held.value


def test_the_engine_on_the_emulated_npu_answers_as_on_the_host(tmp_path):
    version = bf16_dir(tmp_path / "v1", 0.01)
    out = subprocess.run([sys.executable, "-c", _ON_NPU, json.dumps(REQUESTS), str(version)], capture_output=True,
                         text=True, env=_env(SLIME_ASCEND_EMULATE_NPU="1"), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    report = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("REPORT "))[len("REPORT "):])
    assert report["torch_npu"].endswith("+emulated") and report["server_device"] == "npu:0"
    for key in ("param_devices", "buffer_devices", "param_devices_after_update", "param_devices_after_resume"):
        assert report[key] == ["npu:0"], (key, report[key])
    assert report["healthy"] is True and report["healthy_released"] is False
    # the device's allocator held the weights, and gave them back at release
    released = report["released"]
    assert released["device_bytes_before"] > 100_000 > released["device_bytes_after"], released

    host = TorchEngine(device="cpu", return_original_logprob=False)
    _assert_alike(report["before"], _answers(host))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert report["weights_before"] == _weights(host, name)
    host.update_weights_from_disk(str(version), weight_version="v1")
    _assert_alike(report["updated"], _answers(host))
    assert [a["output_ids"] for a in report["updated"]] != [a["output_ids"] for a in report["before"]]
    assert report["weights_after"] == _weights(host, name)
    assert report["resumed"] == report["updated"]  # release and resume: the same answers, bit for bit

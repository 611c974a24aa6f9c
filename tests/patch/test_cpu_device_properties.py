"""train.cpu_device_properties: torch.cuda.get_device_properties on a host without CUDA, and the
Megatron check it exists for (validate_args with TP or CP above 1), each in a subprocess (the shim
changes torch for the whole process)."""

import json

import pytest
import torch

from conftest import run_python
from slime_ascend import patch
from slime_ascend.cpu import plugin

PATCH_ID = "train.cpu_device_properties"

PROBE = r"""
import json, os, torch
from slime_ascend import patch

def props():
    try:
        p = torch.cuda.get_device_properties(torch.device("cuda:0"))
        return {"name": p.name, "major": p.major, "total": p.total_memory, "sms": p.multi_processor_count}
    except Exception as exc:
        return "raised " + type(exc).__name__

out = {"before": props()}
p = patch.install(%r)
out["during"] = props()
p.remove()
out["after"] = props()
with open("/proc/meminfo") as f:
    out["meminfo_total"] = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemTotal:"))
out["cpus"] = os.cpu_count()
print(json.dumps(out))
""" % PATCH_ID


@pytest.fixture(scope="module")
def probed():
    if torch.cuda.is_available():
        pytest.skip("the cpu shims refuse a host with CUDA")
    proc = run_python(PROBE)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_host_properties_while_applied_and_torch_restored_after(probed):
    assert str(probed["before"]).startswith("raised"), probed["before"]
    assert probed["during"] == {"name": "cpu", "major": 10, "total": probed["meminfo_total"], "sms": probed["cpus"]}
    assert probed["after"] == probed["before"]


def test_declared_with_the_other_torch_shims():
    uses = {u.patch: u for u in plugin.PLUGIN.patches}
    assert (uses[PATCH_ID].moment, uses[PATCH_ID].when) == ("import:megatron.core",
                                                            "slime_ascend.cpu.plugin.host_without_cuda")
    p = patch.get(PATCH_ID)
    assert p.targets == ("torch:cuda.get_device_properties",) and p.process == "train"


def test_check_refuses_a_working_cuda(monkeypatch):
    p = patch.get(PATCH_ID)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert any("is_available() is True" in problem for problem in p.check({"torch": torch}))


# Megatron's own validate_args with TP 2 (what slime's driver runs in parse_args): without the shim it stops
# in get_device_arch_version; with it, TP 2 passes and, as on Blackwell, needs no CUDA_DEVICE_MAX_CONNECTIONS
MEGATRON_TP2 = r"""
import os, sys, typing
os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
if not hasattr(typing, "override"):
    import typing_extensions; typing.override = typing_extensions.override
from megatron.training.arguments import parse_args, validate_args
from slime_ascend import patch
sys.argv = ["x", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--tensor-model-parallel-size", "2",
            "--transformer-impl", "local", "--no-gradient-accumulation-fusion"]
os.environ.update(WORLD_SIZE="2", RANK="0")
def attempt():
    args = parse_args(ignore_unknown_args=True)
    try:
        validate_args(args)
        return "ok"
    except Exception as exc:
        return type(exc).__name__ + ": " + str(exc)[:200]
print("WITHOUT", attempt())
patch.install("train.cpu_device_properties")
print("WITH", attempt())
"""


@pytest.mark.slime
def test_megatron_validate_args_with_tensor_parallel():
    if torch.cuda.is_available():
        pytest.skip("needs a host without CUDA")
    proc = run_python(MEGATRON_TP2, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("WITHOUT", "WITH ")))
    assert lines["WITHOUT"] != "ok" and "CUDA" in lines["WITHOUT"] + proc.stderr, lines
    assert lines["WITH"] == "ok", lines

"""The cpu plugin's runtime patches: driver.ray_cpu_resources and the four train.cpu_* torch shims.

The torch shims change torch for the whole process, so they are applied only in a subprocess."""

import json
import types

import pytest
import torch

from conftest import run_python
from slime_ascend import patch
from slime_ascend.patch.driver import ray_cpu_resources, ray_npu_resources

TORCH_PATCHES = ("train.cpu_current_device", "train.cpu_streams", "train.cpu_device_map", "train.cpu_tensor_type")


# -- driver.ray_cpu_resources ------------------------------------------------------------------
def test_translation_without_a_device_resource():
    from slime_ascend.patch.driver.ray_npu_resources import translate_bundles, translate_options

    assert translate_options({"num_gpus": 0.4, "num_cpus": 0.4}, None) == {"num_cpus": 0.4}
    assert translate_options({"num_gpus": 1, "resources": {"x": 1}}, None) == {"resources": {"x": 1}}
    assert translate_bundles([{"GPU": 1, "CPU": 1}], None) == [{"CPU": 1}]
    assert translate_bundles([{"GPU": 1, "CPU": 1}, {"CPU": 2}], None) == [{"CPU": 1}, {"CPU": 2}]


def test_npu_translation_is_unchanged():
    from slime_ascend.patch.driver.ray_npu_resources import translate_bundles, translate_options

    assert translate_options({"num_gpus": 0.4, "num_cpus": 0.4}) == {"num_cpus": 0.4, "resources": {"NPU": 0.4}}
    assert translate_options({"num_gpus": 1, "resources": {"NPU": 1}}, "NPU") == {"resources": {"NPU": 2}}
    assert translate_bundles([{"GPU": 1, "CPU": 1}]) == [{"CPU": 1, "NPU": 1}]
    assert ray_npu_resources.NPURay.RESOURCE == "NPU"
    assert patch.get("driver.ray_npu_resources").VIEW is ray_npu_resources.NPURay
    assert patch.get("driver.ray_cpu_resources").VIEW is ray_cpu_resources.CPURay
    assert ray_cpu_resources.CPURay.RESOURCE is None


def _ray_stub():
    calls = []

    class Remote:
        def __init__(self, target, options):
            self.target, self.options_given = target, options

        def options(self, **options):
            calls.append(("options", options))
            return self

        def remote(self, *args, **kwargs):
            return ("remote", self.target, args, kwargs)

    def remote(*args, **options):
        if args:
            return Remote(args[0], {})
        calls.append(("decorator", options))
        return lambda target: Remote(target, options)

    def get_runtime_context():
        raise AssertionError("the cpu view must not ask Ray for accelerator ids")

    stub = types.SimpleNamespace(remote=remote, get_runtime_context=get_runtime_context,
                                 cluster_resources=lambda: {"CPU": 8.0, "memory": 1.0},
                                 available_resources=lambda: {"CPU": 3.0}, other="passthrough")
    return stub, calls


def test_cpu_ray_view_on_a_stub():
    stub, calls = _ray_stub()
    view = ray_cpu_resources.CPURay(stub)
    assert view.get_gpu_ids() == [0]
    assert view.other == "passthrough"
    assert view.cluster_resources() == {"CPU": 8.0, "memory": 1.0, "GPU": 8.0}
    assert view.available_resources()["GPU"] == 3.0

    actor = view.remote(num_gpus=1, num_cpus=1)(object)
    assert calls[-1] == ("decorator", {"num_cpus": 1})
    actor.options(num_gpus=0.4, num_cpus=0.4)
    assert calls[-1] == ("options", {"num_cpus": 0.4})
    bare = view.remote(object)  # @ray.remote without arguments
    bare.options(num_gpus=1)
    assert calls[-1] == ("options", {})

    seen = []
    placement_group = ray_npu_resources.device_placement_group(lambda bundles, **kw: seen.append(bundles), None)
    placement_group([{"GPU": 1, "CPU": 1}] * 2, strategy="PACK")
    assert seen == [[{"CPU": 1}, {"CPU": 1}]]


@pytest.mark.slime
def test_ray_cpu_resources_matches_real_slime():
    assert patch.get("driver.ray_cpu_resources").verify() == []


@pytest.mark.slime
def test_ray_cpu_resources_installs_on_placement_group_and_removes():
    import slime.ray.placement_group as pg_mod

    p = patch.get("driver.ray_cpu_resources")
    original = (pg_mod.ray, pg_mod.placement_group, pg_mod.InfoActor)
    p.install(modules={"slime.ray.placement_group": pg_mod})
    try:
        assert type(pg_mod.ray) is ray_cpu_resources.CPURay and pg_mod.ray.get_gpu_ids() == [0]
        assert pg_mod.placement_group.__wrapped__ is original[1]
        assert pg_mod.InfoActor._defaults == {"num_gpus": 0, "resources": {}}
        assert pg_mod.InfoActor._wrapped is original[2]
    finally:
        p.remove()
    assert pg_mod.ray is original[0] and pg_mod.placement_group is original[1] and pg_mod.InfoActor is original[2]
    assert not p.applied


# -- train.cpu_* ------------------------------------------------------------------------------
SHIM_CHECK = r"""
import json, torch
from slime_ascend import patch

def behaviour():
    out = {}
    def probe(name, fn):
        try:
            out[name] = fn()
        except Exception as exc:
            out[name] = "raised " + type(exc).__name__
    probe("empty_cuda", lambda: torch.empty(2, device="cuda").device.type)
    probe("full_cuda1", lambda: torch.full((2,), 1.0, device="cuda:1").device.type)
    probe("zeros_current", lambda: torch.zeros(2, device=torch.cuda.current_device()).device.type)
    probe("new_zeros", lambda: torch.zeros(1).new_zeros(3, device="cuda").device.type)
    probe("to_cuda", lambda: torch.zeros(1).to("cuda").device.type)
    probe("module_to", lambda: torch.nn.Linear(2, 2).to(torch.device("cuda", 0)).weight.device.type)
    probe("pin", lambda: torch.zeros(2).pin_memory().is_pinned())
    probe("current_device", lambda: torch.cuda.current_device())
    probe("tensor_cuda", lambda: torch.zeros(1).cuda().device.type)
    probe("module_cuda", lambda: torch.nn.Linear(2, 2).cuda().weight.device.type)
    probe("synchronize", lambda: torch.cuda.synchronize())
    probe("rng_state", lambda: isinstance(torch.cuda.get_rng_state(), torch.Tensor))
    # what Megatron's activation recompute reads (tensor_parallel/random.py _get_cuda_rng_state)
    probe("random_rng_state", lambda: torch.equal(torch.cuda.random.get_rng_state(), torch.get_rng_state()))
    probe("stream", lambda: type(torch.cuda.Stream()).__name__)
    def ctx():
        s = torch.cuda.Stream(priority=-1)
        with torch.cuda.stream(s):
            e = torch.cuda.Event(enable_timing=True); e.record(); f = torch.cuda.Event(enable_timing=True); f.record()
        return e.elapsed_time(f) >= 0
    probe("stream_ctx", ctx)
    probe("type", lambda: torch.zeros(2).type())
    probe("type_bf16", lambda: torch.zeros(2, dtype=torch.bfloat16).type())
    probe("type_convert", lambda: str(torch.zeros(2).type(torch.float64).dtype))
    probe("cpu_ok", lambda: torch.ones(2, device="cpu").sum().item())
    return out

result = {"before": behaviour(), "each": {}}
for pid in %r:
    p = patch.install(pid)
    result["each"][pid] = {"during": behaviour(), "applied": p.applied}
    p.remove()
    result["each"][pid]["after"] = behaviour()
    result["each"][pid]["applied_after"] = p.applied
ps = [patch.install(pid) for pid in %r]
result["all"] = behaviour()
for p in ps:
    p.remove()
result["after_all"] = behaviour()
print(json.dumps(result))
""" % (TORCH_PATCHES, TORCH_PATCHES)

# what each patch makes work (the probe's value while it is applied)
EXPECTED = {
    "train.cpu_current_device": {"current_device": 0, "tensor_cuda": "cpu", "module_cuda": "cpu", "synchronize": None,
                                 "rng_state": True, "random_rng_state": True},
    "train.cpu_streams": {"stream": "Stream", "stream_ctx": True},
    "train.cpu_device_map": {"empty_cuda": "cpu", "full_cuda1": "cpu", "new_zeros": "cpu", "to_cuda": "cpu",
                             "module_to": "cpu", "pin": False},
    "train.cpu_tensor_type": {"type": "torch.cuda.FloatTensor", "type_bf16": "torch.cuda.BFloat16Tensor"},
}


@pytest.fixture(scope="module")
def shim_result():
    if torch.cuda.is_available():
        pytest.skip("the cpu shims refuse a host with CUDA")
    proc = run_python(SHIM_CHECK)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_torch_without_shims_refuses_cuda(shim_result):
    before = shim_result["before"]
    for key in ("empty_cuda", "to_cuda", "current_device", "tensor_cuda", "stream"):
        assert str(before[key]).startswith("raised"), (key, before[key])
    assert before["type"] == "torch.FloatTensor"
    assert before["type_convert"] == "torch.float64"


@pytest.mark.parametrize("patch_id", TORCH_PATCHES)
def test_each_shim_applies_and_removes(shim_result, patch_id):
    each = shim_result["each"][patch_id]
    assert each["applied"] is True and each["applied_after"] is False
    for key, value in EXPECTED[patch_id].items():
        assert each["during"][key] == value, (key, each["during"][key])
    assert each["during"]["type_convert"] == "torch.float64"
    assert each["during"]["cpu_ok"] == 2.0
    assert each["after"] == shim_result["before"]  # torch behaves exactly as before


def test_all_shims_together(shim_result):
    together = shim_result["all"]
    for expected in EXPECTED.values():
        for key, value in expected.items():
            assert together[key] == value, (key, together[key])
    assert together["zeros_current"] == "cpu"  # current_device() 0 mapped to the host
    assert together["type_convert"] == "torch.float64"
    assert shim_result["after_all"] == shim_result["before"]
    assert shim_result["after_all"]["type"] == "torch.FloatTensor"


@pytest.mark.parametrize("patch_id", TORCH_PATCHES)
def test_check_refuses_a_working_cuda(monkeypatch, patch_id):
    p = patch.get(patch_id)
    if not torch.cuda.is_available():
        assert p.check({"torch": torch}) == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    problems = p.check({"torch": torch})
    assert any("is_available() is True" in problem for problem in problems), problems
    try:
        with pytest.raises(patch.PatchTargetError):
            p.install()
        assert not p.applied
    finally:
        p.remove()


def test_check_reports_a_missing_target():
    p = patch.get("train.cpu_streams")
    fake = types.SimpleNamespace(__name__="torch", cuda=types.SimpleNamespace(is_available=lambda: False),
                                 cpu=types.SimpleNamespace())
    problems = p.check({"torch": fake})
    assert "torch.cuda.Stream is missing" in problems and "torch.cpu.Stream is missing" in problems


def test_plugin_skips_the_shims_where_cuda_works(monkeypatch):
    """The shims are declared for Megatron-core's import with the condition host_without_cuda."""
    from slime_ascend.cpu import plugin

    uses = {u.patch: u for u in plugin.PLUGIN.patches}
    for pid in TORCH_PATCHES:
        assert (uses[pid].moment, uses[pid].when) == ("import:megatron.core", "slime_ascend.cpu.plugin.host_without_cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert plugin.host_without_cuda() is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert plugin.host_without_cuda() is True


DEVICE_CONTEXT_CHECK = r"""
import json, torch
from slime_ascend import patch
p = patch.install("train.cpu_device_map")  # before any torch.device(...) context filled torch's factory cache
with torch.device("meta"):
    during = [torch.empty(2).device.type, torch.nn.Linear(2, 2).weight.device.type]
p.remove()
with torch.device("meta"):
    after = [torch.empty(2).device.type, torch.zeros(2).device.type]
print(json.dumps({"during": during, "after": after}))
"""


def test_device_map_keeps_device_contexts_working():
    """transformers builds models under ``with torch.device("meta")``: the wrapped factories must not stop that
    context from placing torch's own factories, while the patch stands or after it is removed."""
    if torch.cuda.is_available():
        pytest.skip("the cpu shims refuse a host with CUDA")
    proc = run_python(DEVICE_CONTEXT_CHECK)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"during": ["meta", "meta"], "after": ["meta", "meta"]}

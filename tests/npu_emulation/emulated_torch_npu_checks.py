"""Checks of the emulated ``torch_npu`` package, ``torch.npu`` and ``transfer_to_npu``, run in a subprocess with the
emulation installed and ``ASCEND_RT_VISIBLE_DEVICES=4,5,6`` (test_emulated_torch_npu.py runs them)."""

import importlib.util
import sys
import tempfile
import warnings

import pytest
import torch

import torch_npu


def check_torch_npu_is_the_emulated_package_and_counts_as_installed():
    from slime_ascend import host

    assert torch_npu.__version__.endswith("+emulated") and torch_npu._SLIME_ASCEND_EMULATED is True
    assert torch_npu.npu is torch.npu is torch.get_device_module("npu") is sys.modules["torch_npu.npu"]
    for name in ("torch_npu.npu.memory", "torch_npu.npu.amp", "torch_npu.contrib", "torch_npu.utils",
                 "torch_npu.distributed"):
        assert name in sys.modules, name
    assert importlib.util.find_spec("torch_npu") is not None and host.torch_npu_installed()
    assert torch.npu.memory is sys.modules["torch_npu.npu.memory"]


def check_device_count_follows_ascend_rt_visible_devices():
    assert torch.npu.is_available() and torch.npu.device_count() == 3
    from slime_ascend.npu_emulation.npu_module import configured_device_count, parse_visible_devices

    assert parse_visible_devices("0,3,x,5") == [0, 3] and parse_visible_devices("") == []
    assert configured_device_count({}) == 8 and configured_device_count({"SLIME_ASCEND_EMULATED_NPUS": "2"}) == 2
    assert configured_device_count({"ASCEND_RT_VISIBLE_DEVICES": "1,2", "SLIME_ASCEND_EMULATED_NPUS": "5"}) == 2
    with pytest.raises(RuntimeError, match="out of range"):
        torch.npu.set_device(3)


def check_device_selection_and_synchronisation():
    torch.npu.set_device(2)
    assert torch.npu.current_device() == 2 and torch.empty(1, device="npu").device.index == 2
    with torch.npu.device(1):
        assert torch.npu.current_device() == 1
    assert torch.npu.current_device() == 2
    torch.npu.set_device("npu:0")
    assert torch.npu.current_device() == 0
    assert torch.npu.synchronize() is None and torch.npu.synchronize(1) is None
    assert torch.npu.empty_cache() is None and torch.npu.ipc_collect() is None
    assert torch.npu.is_initialized() and torch.npu.is_bf16_supported()


def check_memory_api():
    x = torch.empty(256, dtype=torch.uint8, device="npu")
    assert torch.npu.memory_allocated() >= 256 and torch.npu.memory_reserved() == torch.npu.memory_allocated()
    assert torch.npu.max_memory_reserved() >= torch.npu.memory_reserved()
    stats = torch.npu.memory_stats()
    assert stats["allocated_bytes.all.current"] == torch.npu.memory_allocated() and stats["num_ooms"] == 0
    free, total = torch.npu.mem_get_info(0)
    assert 0 < free <= total
    torch.npu.memory._set_allocator_settings("expandable_segments:True")
    with pytest.raises(RuntimeError, match="expandable_segments:True or False"):
        torch.npu.memory._set_allocator_settings("max_split_size_mb:64")
    del x


def check_properties_and_names():
    props = torch.npu.get_device_properties(0)
    assert props.name == torch.npu.get_device_name() == "Ascend910B-emulated"
    assert props.total_memory > 0 and props.major is None  # torch_npu leaves the CUDA-only fields unset
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert torch.npu.get_device_capability() is None
    with pytest.raises(AssertionError, match="Invalid device id"):
        torch.npu.get_device_name(7)


def check_streams_and_events():
    default = torch.npu.default_stream()
    assert torch.npu.current_stream() == default and default.query()
    side = torch.npu.Stream()
    with torch.npu.stream(side):
        assert torch.npu.current_stream() == side
    assert torch.npu.current_stream() == default
    side.wait_stream(default)
    start, end = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
    start.record()
    torch.ones(1000, device="npu").sum()
    end.record(side)
    end.synchronize()
    assert end.query() and start.elapsed_time(end) >= 0
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        torch.npu.Event().elapsed_time(torch.npu.Event())
    torch.ones(2, device="npu").record_stream(side)


def check_random_state_api():
    torch.npu.manual_seed_all(11)
    assert torch.npu.initial_seed() == 11 and len(torch.npu.default_generators) == 3
    states = torch.npu.get_rng_state_all()
    first = torch.rand(4, device="npu")
    torch.npu.set_rng_state_all(states)
    assert torch.equal(first.cpu(), torch.rand(4, device="npu").cpu())
    assert torch.npu.get_rng_state(1).dtype == torch.uint8


def check_ops_module_is_hooked_in():
    if importlib.util.find_spec("slime_ascend.npu_emulation.ops") is None:
        return
    from slime_ascend.npu_emulation import ops

    for name in ops.registered():
        assert getattr(torch_npu, name) is getattr(torch.ops.npu, name), name


def check_transfer_to_npu_redirects_cuda():
    from torch_npu.contrib import transfer_to_npu  # noqa: F401  (importing it applies it, as the real one)
    import torch.distributed as dist

    assert torch.cuda.is_available() and torch.cuda.device_count() == 3
    torch.cuda.set_device(1)
    assert torch.cuda.current_device() == 1
    assert torch.empty(2, device="cuda").device == torch.device("npu", 1)
    assert torch.zeros(2, device=torch.device("cuda", 0)).device == torch.device("npu", 0)
    assert torch.ones(2, device=torch.cuda.current_device()).device == torch.device("npu", 1)
    assert torch.ones(2).cuda().device.type == "npu" and torch.ones(2).to("cuda:2").device.index == 2
    model = torch.nn.Linear(2, 2).cuda()
    assert model.weight.device.type == "npu" and model.weight.is_cuda
    assert torch.nn.Linear(2, 2).to("cuda").weight.device.type == "npu"
    assert torch.cuda.Stream is torch.npu.Stream and torch.cuda.Event is torch.npu.Event
    assert torch.cuda.DoubleTensor is torch.npu.FloatTensor and torch.cuda.CUDAGraph is torch.npu.NPUGraph
    assert torch.cuda.get_device_properties("cuda:0").name == "Ascend910B-emulated"
    assert torch.cuda.memory_allocated("cuda:1") == torch.npu.memory_allocated(1)
    assert dist.is_nccl_available() and "cuda" not in dist.Backend.default_device_backend_map
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            assert dist.get_backend() == "hccl"
            t = torch.ones(3, device="cuda")
            dist.all_reduce(t)
            assert t.device.type == "npu" and t.sum().item() == 3.0
        finally:
            dist.destroy_process_group()
    torch.cuda.set_device(0)

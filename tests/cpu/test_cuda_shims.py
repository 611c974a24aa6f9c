"""The pure torch.cuda stand-ins of the cpu plugin (slime_ascend.cpu.cuda_shims), called directly:
nothing here patches torch."""

import pytest
import torch

from slime_ascend.cpu import cuda_shims as shims

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "device, is_cuda",
    [
        ("cuda", True),
        ("cuda:1", True),
        (torch.device("cuda", 0), True),
        (torch.device("cuda"), True),
        (0, True),  # a bare int is the current accelerator
        (3, True),
        (True, False),  # bool is an int subclass, not a device
        (False, False),
        ("cpu", False),
        (torch.device("cpu"), False),
        ("meta", False),
        (torch.device("meta"), False),
        ("cudax", False),
        (None, False),
        (torch.float32, False),
    ],
)
def test_is_cuda_device_and_host_device(device, is_cuda):
    assert shims.is_cuda_device(device) is is_cuda
    mapped = shims.host_device(device)
    if is_cuda:
        assert mapped == CPU and isinstance(mapped, torch.device)
    else:
        assert mapped is device  # passed through untouched


def test_map_device_kwarg_rewrites_device_and_drops_pin_memory():
    seen = []

    def fake_factory(*args, **kwargs):
        seen.append((args, kwargs))
        return "made"

    wrapped = shims.map_device_kwarg(fake_factory)
    assert wrapped.__wrapped__ is fake_factory
    assert wrapped(2, 3, device="cuda:1", pin_memory=True, dtype=torch.float16) == "made"
    args, kwargs = seen[-1]
    assert args == (2, 3)
    assert kwargs == {"device": CPU, "pin_memory": False, "dtype": torch.float16}

    wrapped(1, device="meta")
    assert seen[-1][1] == {"device": "meta"}
    wrapped(1)
    assert seen[-1][1] == {}  # no device keyword is added
    wrapped(1, pin_memory=False)
    assert seen[-1][1] == {"pin_memory": False}


def test_map_device_kwarg_on_real_torch_factories():
    empty = shims.map_device_kwarg(torch.empty)
    t = empty(3, device="cuda", pin_memory=True)
    assert t.device == CPU and t.shape == (3,) and not t.is_pinned()
    z = shims.map_device_kwarg(torch.zeros)(2, device=torch.device("cuda", 0), dtype=torch.bfloat16)
    assert z.device == CPU and z.dtype == torch.bfloat16 and z.sum().item() == 0
    with pytest.raises(RuntimeError):  # the unwrapped factory still refuses cuda here
        torch.empty(1, device="cuda")


def test_map_to_args_positional_keyword_and_dtype_only():
    seen = []

    def fake_to(self, *args, **kwargs):
        seen.append((self, args, kwargs))
        return self

    to = shims.map_to_args(fake_to)
    assert to.__wrapped__ is fake_to
    to("x", "cuda")
    assert seen[-1] == ("x", (CPU,), {})
    to("x", torch.device("cuda", 1), torch.float16, non_blocking=True)
    assert seen[-1] == ("x", (CPU, torch.float16), {"non_blocking": True})
    to("x", 0)
    assert seen[-1] == ("x", (CPU,), {})
    to("x", device="cuda:0", dtype=torch.float64)
    assert seen[-1] == ("x", (), {"device": CPU, "dtype": torch.float64})
    to("x", torch.float64)  # dtype only: untouched
    assert seen[-1] == ("x", (torch.float64,), {})
    to("x", "meta")
    assert seen[-1] == ("x", ("meta",), {})


def test_map_to_args_on_real_tensor_to():
    to = shims.map_to_args(torch.Tensor.to)
    x = torch.arange(4, dtype=torch.float32)
    assert to(x, "cuda").device == CPU
    assert to(x, "cuda:1", torch.float64).dtype == torch.float64
    assert to(x, device=torch.device("cuda", 0)).device == CPU
    y = to(x, torch.int64)
    assert y.dtype == torch.int64 and y.tolist() == [0, 1, 2, 3]
    other = torch.zeros(1, dtype=torch.float16)
    assert to(x, other).dtype == torch.float16  # .to(tensor) passes through


def test_cuda_type_string_without_args_and_conversion_with_args():
    type_ = shims.cuda_type_string(torch.Tensor.type)
    assert type_.__wrapped__ is torch.Tensor.type
    assert type_(torch.zeros(2)) == "torch.cuda.FloatTensor"
    assert type_(torch.zeros(2, dtype=torch.bfloat16)) == "torch.cuda.BFloat16Tensor"
    assert type_(torch.zeros(2, dtype=torch.float16)) == "torch.cuda.HalfTensor"
    assert type_(torch.zeros(2, dtype=torch.int64)) == "torch.cuda.LongTensor"
    converted = type_(torch.ones(2), torch.float64)
    assert isinstance(converted, torch.Tensor) and converted.dtype == torch.float64
    assert type_(torch.ones(2), "torch.DoubleTensor").dtype == torch.float64
    assert type_(torch.ones(2), dtype=torch.int32).dtype == torch.int32
    # a meta tensor is not the host: its name is left alone
    assert not type_(torch.empty(2, device="meta")).startswith("torch.cuda.")
    # the unwrapped method is unchanged
    assert torch.zeros(2).type() == "torch.FloatTensor"


def test_event_elapsed_time():
    start, end = shims.Event(enable_timing=True), shims.Event(enable_timing=True)
    with pytest.raises(RuntimeError):
        start.elapsed_time(end)
    start.record()
    with pytest.raises(RuntimeError):  # the end event is not recorded yet
        start.elapsed_time(end)
    sum(range(10000))
    end.record()
    elapsed = start.elapsed_time(end)
    assert isinstance(elapsed, float) and elapsed >= 0
    assert start.query() and end.query()
    end.synchronize()
    end.wait()


def test_stream_with_device_and_priority():
    s = shims.Stream(device=0, priority=-1)
    assert isinstance(s, torch.cpu.Stream)
    assert shims.Stream() is not None and shims.Stream(torch.device("cuda", 1)) is not None
    assert s.query() is True
    s.synchronize()
    s.wait_stream(shims.Stream())
    ev = s.record_event()
    assert isinstance(ev, shims.Event) and ev._time is not None
    mine = shims.Event()
    assert s.record_event(mine) is mine and mine._time is not None
    with shims.stream(s) as entered:
        assert entered is s
    assert shims.current_stream() is not None and shims.default_stream(0) is not None


def test_device_functions():
    assert shims.current_device() == 0
    assert shims.set_device(3) is None and shims.synchronize() is None and shims.empty_cache() is None
    state = shims.get_rng_state()
    assert isinstance(state, torch.Tensor) and torch.equal(state, torch.get_rng_state())
    first = torch.rand(3)
    shims.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)  # the host generator stands for the device one
    x = torch.zeros(2)
    assert shims.tensor_cuda(torch.Tensor.cuda)(x) is x
    m = torch.nn.Linear(2, 2)
    assert shims.module_cuda(torch.nn.Module.cuda)(m, 0) is m
    assert shims.tensor_pin_memory(torch.Tensor.pin_memory)(x) is x


def test_host_memory_reads_proc_meminfo():
    with open("/proc/meminfo") as f:
        total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    avail, total = shims.host_memory()
    assert total == total_kib * 1024 and 0 < avail <= total

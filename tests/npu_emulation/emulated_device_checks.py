"""Checks of the emulated ``npu`` device, run in a subprocess with the emulation installed
(test_emulated_device.py runs them, one test each)."""

import copy
import io
import pickle

import pytest
import torch


def npu_tensors(*tensors):
    return all(isinstance(t, torch.Tensor) and t.device.type == "npu" for t in tensors)


def check_device_type_factories_and_host_copies():
    assert torch.device("npu").type == "npu" and str(torch.device("npu", 3)) == "npu:3"
    host = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    x = host.to("npu")
    assert x.device == torch.device("npu", 0) and x.is_npu and not x.is_cuda and x.get_device() == 0
    assert host.to("npu:1").device == torch.device("npu", 1) and host.npu(2).device.index == 2
    for made in (torch.empty(2, 3, device="npu"), torch.zeros(4, device="npu:0"), torch.ones(2, device="npu"),
                 torch.full((2,), 7.0, device="npu"), torch.arange(5, device="npu"), torch.randperm(6, device="npu"),
                 torch.tensor([1, 2], device="npu"), torch.tensor(1.5, device="npu"), torch.eye(3, device="npu"),
                 torch.tril_indices(3, 3, device="npu"), torch.randn(2, 2, device="npu"), x.new_zeros(3),
                 torch.empty_like(x), torch.zeros_like(host, device="npu")):
        assert made.device.type == "npu", made
    assert torch.arange(5, device="npu").shape == (5,) and torch.arange(5, device="npu").tolist() == [0, 1, 2, 3, 4]
    back = x.cpu()
    assert type(back) is torch.Tensor and back.device.type == "cpu" and torch.equal(back, host)
    assert torch.empty_like(x, device="cpu").device.type == "cpu"
    dst = torch.empty(3, 4, device="npu")
    dst.copy_(host)
    out = torch.zeros(3, 4)
    out.copy_(dst)
    assert torch.equal(out, host) and torch.equal((x + x).cpu(), host * 2)
    assert x.sum().item() == 66.0 and x[1, 2].item() == 6.0 and x.tolist() == host.tolist()
    assert x.type() == "torch.npu.FloatTensor" and isinstance(x, torch.npu.FloatTensor)


def check_mlp_step_with_adamw_stays_on_npu_and_matches_the_host():
    torch.manual_seed(0)
    host_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model = copy.deepcopy(host_model).to("npu")
    inputs, targets = torch.randn(32, 8), torch.randn(32, 1)
    opt_host = torch.optim.AdamW(host_model.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        for m, o, x, y in ((host_model, opt_host, inputs, targets), (model, opt, inputs.to("npu"), targets.to("npu"))):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            o.step()
        losses.append(loss.item())
        assert npu_tensors(loss)
    assert losses[-1] < losses[0]
    params = list(model.parameters())
    assert all(isinstance(p, torch.nn.Parameter) for p in params)
    assert npu_tensors(*params) and npu_tensors(*(p.grad for p in params))
    state = [v for s in opt.state.values() for k, v in s.items() if k != "step"]  # torch keeps "step" on the host
    assert len(state) == 2 * len(params) and npu_tensors(*state)
    for p, q in zip(params, host_model.parameters()):
        assert torch.allclose(p.cpu(), q, atol=1e-6), (p.cpu() - q).abs().max()


def check_mixed_devices_raise_as_on_a_device():
    a = torch.ones(4, device="npu")
    for op in (lambda: a + torch.ones(4), lambda: torch.ones(2, 4) @ torch.ones(4, 2, device="npu"),
               lambda: torch.cat([a, torch.ones(4)]), lambda: a.to("npu:1") * a, lambda: torch.where(a > 0, a, torch.zeros(4))):
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            op()
    assert (a + torch.tensor(2.0)).device.type == "npu"  # a 0-dim host tensor is a scalar, as with CUDA
    assert a[torch.tensor([0, 2])].device.type == "npu"  # host indices are accepted, as with CUDA


def check_printing_and_serialization():
    x = torch.tensor([1.0, 2.0], device="npu")
    assert repr(x) == "tensor([1., 2.], device='npu:0')", repr(x)
    assert repr(torch.nn.Parameter(x)).startswith("Parameter containing:\ntensor([1., 2.], device='npu:0'")
    assert f"{x.sum():.1f}" == "3.0"
    buffer = io.BytesIO()
    model = torch.nn.Linear(3, 2).to("npu")
    torch.save({"state": model.state_dict(), "x": x.bfloat16()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # weights_only: torch's own rebuild of a storage-less device tensor
    assert npu_tensors(*loaded["state"].values(), loaded["x"]) and loaded["x"].dtype == torch.bfloat16
    assert torch.equal(loaded["state"]["weight"].cpu(), model.weight.detach().cpu())
    buffer.seek(0)
    assert torch.load(buffer, map_location="cpu")["x"].device.type == "cpu"
    twin = copy.deepcopy(model)
    assert npu_tensors(*twin.parameters()) and torch.equal(twin.weight.cpu(), model.weight.cpu())
    assert torch.equal(pickle.loads(pickle.dumps(x)).cpu(), x.cpu())
    with pytest.raises(TypeError, match=r"Tensor\.cpu\(\)"):
        x.numpy()


def check_views_inplace_out_and_data_assignment():
    base = torch.zeros(4, 4, device="npu")
    row = base[1]
    row.fill_(3.0)
    assert base.sum().item() == 12.0  # a view shares the data
    t = torch.zeros(2, 3, device="npu")
    assert t.transpose_(0, 1).shape == (3, 2) and t.unsqueeze_(0).shape == (1, 3, 2)
    out = torch.empty(0, device="npu")
    torch.add(torch.ones(5, device="npu"), 1, out=out)
    assert out.shape == (5,) and out.sum().item() == 10.0
    r = torch.zeros(2, device="npu")
    assert r.resize_(6).shape == (6,)
    p = torch.nn.Parameter(torch.ones(3, device="npu"))
    p.data = torch.full((5,), 2.0, device="npu")
    assert p.shape == (5,) and p.sum().item() == 10.0
    loss = (p * p).sum()
    loss.backward()
    assert torch.equal(p.grad.cpu(), torch.full((5,), 4.0))


def check_memory_is_counted_per_storage():
    before = torch.npu.memory_allocated()
    x = torch.empty(1000, dtype=torch.float32, device="npu")
    assert torch.npu.memory_allocated() == before + 4000
    views = [x[10:], x.view(10, 100), x.detach()]
    assert torch.npu.memory_allocated() == before + 4000 and len(views) == 3
    assert torch.npu.max_memory_allocated() >= before + 4000
    x.untyped_storage().resize_(0)  # Megatron's way of freeing a buffer in place
    assert torch.npu.memory_allocated() == before
    del x, views
    torch.npu.reset_peak_memory_stats()
    assert torch.npu.max_memory_allocated() == torch.npu.memory_allocated() == before
    free, total = torch.npu.mem_get_info()
    assert 0 < free <= total == torch.npu.get_device_properties(0).total_memory


def check_random_numbers_come_from_the_device_generator():
    torch.npu.manual_seed(7)
    a = torch.randn(8, device="npu")
    torch.npu.manual_seed(7)
    torch.randn(100)  # the host generator moving does not move the device's
    b = torch.randn(8, device="npu")
    assert torch.equal(a.cpu(), b.cpu())
    state = torch.npu.get_rng_state()
    c = torch.nn.functional.dropout(torch.ones(64, device="npu"), 0.5)
    torch.npu.set_rng_state(state)
    d = torch.nn.functional.dropout(torch.ones(64, device="npu"), 0.5)
    assert torch.equal(c.cpu(), d.cpu()) and npu_tensors(c)
    torch.manual_seed(3)  # torch seeds every device of the backend too (manual_seed_all)
    assert torch.npu.initial_seed() == 3


def check_autocast_and_pinned_host_memory():
    a, b = torch.randn(4, 4, device="npu"), torch.randn(4, 4, device="npu")
    with torch.autocast("npu", dtype=torch.bfloat16):
        assert (a @ b).dtype == torch.bfloat16 and torch.softmax(a.bfloat16(), -1).dtype == torch.float32
    assert (a @ b).dtype == torch.float32
    pinned = torch.empty(16, pin_memory=True)
    assert pinned.is_pinned() and not torch.empty(16).is_pinned() and torch.ones(3).pin_memory().is_pinned()


def check_backward_runs_on_every_device_index():
    # torch's engine would give npu:1 and up worker threads a Python backend cannot size: the emulation runs the
    # backward pass on the calling thread
    for index in range(3):
        x = torch.ones(3, device=f"npu:{index}", requires_grad=True)
        (x * x).sum().backward()
        (grad,) = torch.autograd.grad((x * 3).sum(), x)
        assert x.grad.device.index == grad.device.index == index and x.grad.tolist() == [2.0] * 3


def check_npu_without_an_index_is_the_current_device_everywhere():
    # torch fills an index-less device from the backend's guard in torch.tensor / as_tensor / new_tensor / Tensor.to
    # (torch_npu's answers the current device; a Python backend's answered 0: a TP rank on npu:1 met npu:0 tensors)
    torch.npu.set_device(1)
    try:
        x = torch.ones(2)
        made = [torch.tensor([1.0], device="npu"), torch.as_tensor([1.0], device=torch.device("npu")),
                x.to("npu"), x.to(torch.device("npu")), x.to(device="npu"), x.to("npu", torch.float16),
                torch.ones(1, device="npu"), torch.ones(1, device="npu:1").new_tensor([2.0], device="npu")]
        assert [t.device for t in made] == [torch.device("npu", 1)] * len(made), [t.device for t in made]
        assert x.to("npu:0").device == torch.device("npu", 0) and x.to(torch.float64).device.type == "cpu"
    finally:
        torch.npu.set_device(0)


def check_backward_through_the_engine_itself_on_npu_2():
    # Megatron's pipeline schedules call the engine itself (custom_backward)
    from torch.autograd.variable import Variable

    y = torch.ones(2, device="npu:2", requires_grad=True)
    out = (y * y).sum()
    Variable._execution_engine.run_backward(tensors=(out,), grad_tensors=(torch.ones_like(out),), keep_graph=False,
                                            create_graph=False, inputs=tuple(), allow_unreachable=True,
                                            accumulate_grad=True)
    assert y.grad.device.index == 2 and y.grad.tolist() == [2.0, 2.0]

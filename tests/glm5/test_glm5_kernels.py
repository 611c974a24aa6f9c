"""The per-device choice of the ops that stand in for slime's tilelang modules (slime_ascend.glm5.kernels), the
NPU sparse-attention adapter driven through the emulated torch_npu operator (op-plugin's schema registered as
torch.ops.npu.npu_sparse_flash_attention, exported on a torch_npu module as torch_npu does, with a host reference
body that enforces the op's documented limits), and patch train.glm5_kernels."""

from __future__ import annotations

import importlib.util
import logging
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slime_ascend.glm5 import kernels, ops
from slime_ascend.glm5.npu_sparse_attention import make_sparse_mla_fwd_interface
from slime_ascend.npu_emulation import ops as npu_ops

EMULATED = importlib.util.find_spec("torch_npu") is None
needs_emulation = pytest.mark.skipif(not EMULATED, reason="a real torch_npu is importable: torch.ops.npu is its")

#: an older torch_npu's op: the same name, no MLA-absorb arguments (a genuinely different schema)
OLD_SCHEMA = ("npu_sparse_flash_attention(Tensor query, Tensor key, Tensor value, Tensor sparse_indices, "
              "float scale_value) -> Tensor")
_OLD_LIBRARY = []


@pytest.fixture
def torch_npu():
    """A torch_npu module exporting the emulated ops (slime_ascend.npu_emulation.ops.attach)."""
    if not EMULATED:
        pytest.skip("a real torch_npu is importable: torch.ops.npu is its")
    npu_ops.register()
    module = types.ModuleType("torch_npu")
    npu_ops.attach(module)
    return module


def _old_torch_npu():
    if not _OLD_LIBRARY:
        library = torch.library.Library("slime_ascend_test_old_npu", "DEF")
        library.define(OLD_SCHEMA)
        library.impl("npu_sparse_flash_attention", lambda *a: pytest.fail("the old op must not be called"),
                     "CompositeExplicitAutograd")
        _OLD_LIBRARY.append(library)
    module = types.ModuleType("torch_npu")
    module.npu_sparse_flash_attention = torch.ops.slime_ascend_test_old_npu.npu_sparse_flash_attention
    return module


class NpuCalls(TorchDispatchMode):
    """Records each call of a torch.ops.npu operator (overload, args, kwargs) as the dispatcher sees it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if func.namespace == "npu":
            self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def test_cpu_gets_the_torch_ops_for_every_name_slimes_wrappers_import():
    functions = kernels.kernel_functions("cpu")
    assert {m: tuple(f) for m, f in functions.items()} == kernels.KERNEL_MODULES
    assert functions["tilelang_sparse_mla_fwd"]["sparse_mla_fwd_interface"] is ops.sparse_mla_fwd_interface
    assert functions["tilelang_indexer_fwd"]["indexer_fwd_interface"] is ops.indexer_fwd_interface


def test_cuda_keeps_slimes_kernels():
    with pytest.raises(ValueError, match="slime's own tilelang kernels"):
        kernels.kernel_functions("cuda")


def test_npu_takes_the_fused_sparse_attention_from_torch_npus_op_object(torch_npu, monkeypatch, caplog):
    """torch_npu.npu_sparse_flash_attention is a torch.ops OpOverloadPacket (Python signature (*args, **kwargs)):
    the choice reads its schema, and says once which forward GLM-5 training takes."""
    monkeypatch.setattr(kernels, "_LOGGED", set(), raising=False)
    with caplog.at_level(logging.INFO, logger="slime_ascend.glm5"):
        fused = kernels.kernel_functions("npu", torch_npu=torch_npu)
        kernels.kernel_functions("npu", torch_npu=torch_npu)
    interface = fused["tilelang_sparse_mla_fwd"]["sparse_mla_fwd_interface"]
    assert interface is not ops.sparse_mla_fwd_interface
    assert interface.__slime_ascend_npu_op__ == "npu_sparse_flash_attention"
    assert fused["tilelang_indexer_fwd"]["indexer_fwd_interface"] is ops.indexer_fwd_interface  # indices, not logits
    assert fused["tilelang_sparse_mla_bwd"]["sparse_mla_bwd"] is ops.sparse_mla_bwd
    chosen = [r.getMessage() for r in caplog.records if "sparse-MLA forward" in r.getMessage()]
    assert chosen == ["GLM-5 sparse-MLA forward: torch_npu.npu_sparse_flash_attention (MLA-absorb, TND), where a "
                      "call fits the op's limits; the torch op otherwise"]


def test_npu_keeps_the_torch_op_for_an_op_of_another_schema_or_none(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_LOGGED", set(), raising=False)
    with caplog.at_level(logging.INFO, logger="slime_ascend.glm5"):
        old = kernels.kernel_functions("npu", torch_npu=_old_torch_npu())
        assert kernels.npu_sparse_attention_op(types.ModuleType("torch_npu")) is None
    assert old["tilelang_sparse_mla_fwd"]["sparse_mla_fwd_interface"] is ops.sparse_mla_fwd_interface
    messages = [r.getMessage() for r in caplog.records]
    assert any("lacks actual_seq_lengths_query, actual_seq_lengths_kv, query_rope" in m for m in messages), messages
    assert any("torch_npu has no npu_sparse_flash_attention" in m for m in messages), messages


def test_param_names_reads_an_op_objects_schema_and_a_functions_signature(torch_npu):
    schema_names = tuple(a.name for a in torch.ops.npu.npu_sparse_flash_attention.default._schema.arguments)
    assert kernels.param_names(torch_npu.npu_sparse_flash_attention) == schema_names  # the packet
    assert kernels.param_names(torch.ops.npu.npu_sparse_flash_attention.default) == schema_names  # an overload
    assert set(kernels.NPU_SPARSE_ATTENTION_PARAMS) <= set(schema_names)
    assert kernels.param_names(lambda query, key, *, scale: None) == ("query", "key", "scale")


def _inputs(dtype, heads=4, seq=10, topk=6):
    torch.manual_seed(0)
    q = torch.randn(seq, heads, 576).to(dtype)
    kv = torch.randn(seq, 1, 576).to(dtype)
    idx = torch.full((seq, 1, topk), -1, dtype=torch.int32)
    for i in range(seq):  # causal, valid first, -1 last: the selection's layout
        keys = torch.arange(i, max(-1, i - topk), -1)
        idx[i, 0, : len(keys)] = keys.to(torch.int32)
    return q, kv, idx


def assert_equal_up_to_the_final_rounding(fused: torch.Tensor, host: torch.Tensor) -> None:
    """Two half-precision results of float32 computations that agree within float32 tolerance: nearly every
    element bit-equal, the rest one unit of the half format apart (the two float32 values straddled a rounding
    boundary of the final cast)."""
    assert fused.dtype == host.dtype and fused.dtype in (torch.bfloat16, torch.float16)
    assert (fused == host).float().mean() >= 0.999
    torch.testing.assert_close(fused.float(), host.float(), rtol=torch.finfo(fused.dtype).eps, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_npu_adapter_passes_contiguous_mla_absorb_arguments_and_gives_the_torch_ops_out_and_lse(torch_npu,
                                                                                                    dtype):
    """slime's q [T, H, 576] and kv [T, 1, 576] split into nope/rope parts the op takes contiguous only (the
    reference body refuses slices); out and slime's base-2 lse equal the torch fallback's within float32
    tolerance (both accumulate in float32 from the same half-precision inputs)."""
    fwd = make_sparse_mla_fwd_interface(torch_npu.npu_sparse_flash_attention)
    q, kv, idx = _inputs(dtype)
    with NpuCalls() as record:
        out, lse = fwd(q, kv, idx, sm_scale=0.05)
    ((func, args, kwargs),) = record.calls
    assert func is torch.ops.npu.npu_sparse_flash_attention.default
    query, key, value, sparse_indices, scale = args
    assert query.shape == (10, 4, 512) and kwargs["query_rope"].shape == (10, 4, 64)
    assert key.shape == (10, 1, 512) and kwargs["key_rope"].shape == (10, 1, 64) and value is key
    assert all(t.is_contiguous() for t in (query, key, sparse_indices, kwargs["query_rope"], kwargs["key_rope"]))
    assert (kwargs["layout_query"], kwargs["layout_kv"], kwargs["attention_mode"]) == ("TND", "TND", 2)
    assert kwargs.get("sparse_mode", 3) == 3  # the dispatcher leaves out an argument equal to the schema's default
    assert kwargs["return_softmax_lse"] is True and scale == 0.05 and sparse_indices.dtype == torch.int32
    assert kwargs["actual_seq_lengths_query"].tolist() == [10] and kwargs["actual_seq_lengths_kv"].tolist() == [10]
    ref_out, ref_lse = ops.sparse_mla_fwd_interface(q, kv, idx, sm_scale=0.05)
    assert out.dtype == ref_out.dtype == dtype and lse.dtype == ref_lse.dtype == torch.float32
    assert_equal_up_to_the_final_rounding(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("case", ["fp32", "d_v", "two_kv_heads", "heads"])
def test_the_npu_adapter_falls_back_to_the_torch_op_outside_the_ops_limits(torch_npu, case):
    fwd = make_sparse_mla_fwd_interface(torch_npu.npu_sparse_flash_attention)
    q, kv, idx = _inputs(torch.float32 if case == "fp32" else torch.bfloat16, heads=3 if case == "heads" else 4)
    kwargs = {"d_v": 256} if case == "d_v" else {}
    if case == "two_kv_heads":
        kv = torch.cat((kv, kv), 1)
        idx = torch.cat((idx, idx), 1)
    with NpuCalls() as record:
        out, lse = fwd(q, kv, idx, sm_scale=0.05, **kwargs)
    assert not record.calls
    torch.testing.assert_close(out, ops.sparse_mla_fwd_interface(q, kv, idx, sm_scale=0.05, **kwargs)[0])


@pytest.mark.slime
def test_slimes_sparse_mla_on_npu_runs_the_fused_forward_and_the_torch_backward(torch_npu, monkeypatch):
    """GLM-5's sparse attention as slime's spec calls it (slime's SparseMLA over the patched tilelang modules)
    with device kind npu and the emulated torch_npu: the forward goes through torch.ops.npu's op, forward and
    backward equal the cpu stand-ins'."""
    from slime_ascend.patch.train import glm5_kernels

    q, kv, idx = _inputs(torch.bfloat16)
    results = {}
    monkeypatch.setitem(sys.modules, "torch_npu", torch_npu)
    for device in ("npu", "cpu"):
        monkeypatch.setattr(kernels, "device_kind", lambda device=device: device)
        for name in [n for n in sys.modules if n.startswith(f"{glm5_kernels.OPS}.")]:
            monkeypatch.delitem(sys.modules, name)
        glm5_kernels.PATCH.apply({})
        try:
            from slime_plugins.models.glm5.ops.sparse_mla import SparseMLA

            qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
            with NpuCalls() as record:
                out, _ = SparseMLA.apply(qg, kvg, idx, 0.05)
            (out.float() * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
            results[device] = (out, qg.grad, kvg.grad, len(record.calls))
        finally:
            glm5_kernels.PATCH.remove()
            sys.modules.pop(f"{glm5_kernels.OPS}.sparse_mla", None)
    assert results["npu"][3] == 1 and results["cpu"][3] == 0
    for fused, host in zip(results["npu"][:3], results["cpu"][:3]):
        assert_equal_up_to_the_final_rounding(fused, host)


GLM5_ON_DEVICE = r"""
import torch
from slime_ascend.npu_emulation import install
install()
from slime_ascend.glm5 import kernels, ops
assert kernels.device_kind() == "npu"
fwd = kernels.kernel_functions()["tilelang_sparse_mla_fwd"]["sparse_mla_fwd_interface"]
assert fwd is not ops.sparse_mla_fwd_interface, "the torch op was chosen"
gen = torch.Generator().manual_seed(0)
q = torch.randn(8, 2, 576, generator=gen).bfloat16()
kv = torch.randn(8, 1, 576, generator=gen).bfloat16()
idx = torch.stack([torch.tensor([i, max(i - 1, 0) if i else -1], dtype=torch.int32) for i in range(8)])[:, None]
out, lse = fwd(q.npu(), kv.npu(), idx.npu(), sm_scale=0.1)
ref_out, ref_lse = ops.sparse_mla_fwd_interface(q, kv, idx, sm_scale=0.1)
assert out.device.type == lse.device.type == "npu"
torch.testing.assert_close(lse.cpu(), ref_lse, rtol=1.3e-6, atol=1e-5)
print((out.cpu() == ref_out).float().mean().item())
"""


def test_glm5_on_the_emulated_npu_device_takes_the_fused_op_with_contiguous_inputs():
    """The whole NPU setting: the emulated device and torch_npu installed, device_kind() and kernel_functions() as
    the patch calls them, npu tensors in; the fused op (its reference body refusing non-contiguous inputs) answers
    on the device, equal to the torch op."""
    if not EMULATED:
        pytest.skip("a real torch_npu is importable: the emulation refuses to install")
    from conftest import run_python

    done = run_python(GLM5_ON_DEVICE)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip()) >= 0.999


def test_the_patch_puts_stand_ins_in_sys_modules_and_takes_them_out(monkeypatch):
    from slime_ascend.patch.train import glm5_kernels

    patch = glm5_kernels.PATCH
    names = [f"{glm5_kernels.OPS}.{m}" for m in kernels.KERNEL_MODULES]
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(glm5_kernels, "module_file", lambda _name: None)
    assert patch.check({}) == [f"{glm5_kernels.OPS}.{w} is not found in slime" for w in glm5_kernels.WRAPPERS]
    monkeypatch.setattr(kernels, "device_kind", lambda: "cpu")
    patch.apply({})
    try:
        assert patch.applied
        assert sys.modules[names[0]].indexer_fwd_interface is ops.indexer_fwd_interface
        assert sys.modules[names[3]].sparse_mla_bwd is ops.sparse_mla_bwd
    finally:
        patch.remove()
    assert not patch.applied and not [n for n in names if n in sys.modules]


def test_the_check_names_an_import_the_stand_ins_lack(tmp_path, monkeypatch):
    from slime_ascend.patch.train import glm5_kernels

    wrapper = tmp_path / "indexer.py"
    wrapper.write_text("from .tilelang_indexer_fwd import indexer_fwd_interface, fp8_indexer\n")
    monkeypatch.setattr(glm5_kernels, "module_file", lambda _name: wrapper)
    problems = glm5_kernels.PATCH.check({})
    assert any("imports ['fp8_indexer'] from tilelang_indexer_fwd" in p for p in problems), problems
    monkeypatch.setitem(sys.modules, f"{glm5_kernels.OPS}.tilelang_indexer_bwd", types.ModuleType("real"))
    assert any("already imported" in p for p in glm5_kernels.PATCH.check({}))

"""The per-device choice of the ops that stand in for slime's tilelang modules (slime_ascend.glm5.kernels), the
NPU sparse-attention adapter driven by a fake torch_npu (never the real one), and patch train.glm5_kernels."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from slime_ascend.glm5 import kernels, ops
from slime_ascend.glm5.npu_sparse_attention import make_sparse_mla_fwd_interface


def _fake_torch_npu(calls, signature_ok=True):
    def npu_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, block_table=None,
                                   actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                                   key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                                   sparse_mode=3, pre_tokens=2**63 - 1, next_tokens=2**63 - 1, attention_mode=0,
                                   return_softmax_lse=False):
        calls.append(dict(query=query, key=key, value=value, sparse_indices=sparse_indices, scale=scale_value,
                          lq=actual_seq_lengths_query, lkv=actual_seq_lengths_kv, query_rope=query_rope,
                          key_rope=key_rope, layout=(layout_query, layout_kv), sparse_mode=sparse_mode,
                          attention_mode=attention_mode, lse=return_softmax_lse))
        # what the op computes, in its own statistics: out, row max and row sum of exp(s - max)
        q = torch.cat((query, query_rope), -1).float()
        kv = torch.cat((key, key_rope), -1).float()
        out, lse2 = ops.sparse_mla_fwd_interface(q, kv, sparse_indices, sm_scale=scale_value)
        lse = lse2 * math.log(2.0)
        softmax_max = lse - 1.0
        return out.to(query.dtype), softmax_max[None], torch.exp(lse - softmax_max)[None]

    def old_op(query, key, value, sparse_indices, scale_value):  # an older torch_npu: no MLA-absorb arguments
        raise AssertionError("must not be called")

    module = types.ModuleType("torch_npu")
    module.npu_sparse_flash_attention = npu_sparse_flash_attention if signature_ok else old_op
    module.npu_lightning_indexer = lambda *a, **k: None
    return module


def test_cpu_gets_the_torch_ops_for_every_name_slimes_wrappers_import():
    functions = kernels.kernel_functions("cpu")
    assert {m: tuple(f) for m, f in functions.items()} == kernels.KERNEL_MODULES
    assert functions["tilelang_sparse_mla_fwd"]["sparse_mla_fwd_interface"] is ops.sparse_mla_fwd_interface
    assert functions["tilelang_indexer_fwd"]["indexer_fwd_interface"] is ops.indexer_fwd_interface


def test_cuda_keeps_slimes_kernels():
    with pytest.raises(ValueError, match="slime's own tilelang kernels"):
        kernels.kernel_functions("cuda")


def test_npu_takes_the_fused_sparse_attention_only_when_its_signature_has_every_argument():
    fused = kernels.kernel_functions("npu", torch_npu=_fake_torch_npu([]))
    assert fused["tilelang_sparse_mla_fwd"]["sparse_mla_fwd_interface"] is not ops.sparse_mla_fwd_interface
    assert fused["tilelang_indexer_fwd"]["indexer_fwd_interface"] is ops.indexer_fwd_interface  # indices, not logits
    assert fused["tilelang_sparse_mla_bwd"]["sparse_mla_bwd"] is ops.sparse_mla_bwd
    old = kernels.kernel_functions("npu", torch_npu=_fake_torch_npu([], signature_ok=False))
    assert old["tilelang_sparse_mla_fwd"]["sparse_mla_fwd_interface"] is ops.sparse_mla_fwd_interface
    assert kernels.npu_sparse_attention_op(types.ModuleType("torch_npu")) is None


def test_param_names_reads_a_torch_op_schema_when_there_is_no_python_signature():
    op = types.SimpleNamespace(default=types.SimpleNamespace(_schema=types.SimpleNamespace(
        arguments=[types.SimpleNamespace(name=n) for n in kernels.NPU_SPARSE_ATTENTION_PARAMS])))
    assert kernels.param_names(op) == kernels.NPU_SPARSE_ATTENTION_PARAMS


def _inputs(dtype, heads=4, seq=10, topk=6):
    torch.manual_seed(0)
    q = torch.randn(seq, heads, 576).to(dtype)
    kv = torch.randn(seq, 1, 576).to(dtype)
    idx = torch.full((seq, 1, topk), -1, dtype=torch.int32)
    for i in range(seq):  # causal, valid first, -1 last: the selection's layout
        keys = torch.arange(i, max(-1, i - topk), -1)
        idx[i, 0, : len(keys)] = keys.to(torch.int32)
    return q, kv, idx


def test_the_npu_adapter_passes_mla_absorb_arguments_and_gives_slimes_out_and_lse():
    calls = []
    fwd = make_sparse_mla_fwd_interface(_fake_torch_npu(calls).npu_sparse_flash_attention)
    q, kv, idx = _inputs(torch.bfloat16)
    out, lse = fwd(q, kv, idx, sm_scale=0.05)
    (call,) = calls
    assert call["query"].shape == (10, 4, 512) and call["query_rope"].shape == (10, 4, 64)
    assert call["key"].shape == (10, 1, 512) and call["key_rope"].shape == (10, 1, 64)
    assert call["value"] is call["key"] and call["layout"] == ("TND", "TND") and call["attention_mode"] == 2
    assert call["lse"] is True and call["scale"] == 0.05 and call["sparse_indices"].dtype == torch.int32
    assert call["lq"].tolist() == [10] and call["lkv"].tolist() == [10]
    ref_out, ref_lse = ops.sparse_mla_fwd_interface(q, kv, idx, sm_scale=0.05)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", ["fp32", "d_v", "two_kv_heads", "heads"])
def test_the_npu_adapter_falls_back_to_the_torch_op_outside_the_ops_limits(case):
    calls = []
    fwd = make_sparse_mla_fwd_interface(_fake_torch_npu(calls).npu_sparse_flash_attention)
    q, kv, idx = _inputs(torch.float32 if case == "fp32" else torch.bfloat16, heads=3 if case == "heads" else 4)
    kwargs = {"d_v": 256} if case == "d_v" else {}
    if case == "two_kv_heads":
        kv = torch.cat((kv, kv), 1)
        idx = torch.cat((idx, idx), 1)
    out, lse = fwd(q, kv, idx, sm_scale=0.05, **kwargs)
    assert not calls
    torch.testing.assert_close(out, ops.sparse_mla_fwd_interface(q, kv, idx, sm_scale=0.05, **kwargs)[0])


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

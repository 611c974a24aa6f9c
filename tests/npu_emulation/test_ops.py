"""The emulated torch_npu operators (slime_ascend.npu_emulation.ops): op-plugin's schemas registered verbatim as
torch.ops.npu ops, exported the way torch_npu exports them, reference bodies against per-query loop references
and against plain causal attention, and every documented input constraint refused with a RuntimeError."""

from __future__ import annotations

import importlib.util
import inspect
import types

import pytest
import torch

from slime_ascend.npu_emulation import ops
from slime_ascend.npu_emulation.op_schemas import SCHEMAS, SOURCE

if importlib.util.find_spec("torch_npu") is not None:
    pytest.skip("a real torch_npu is importable: its ops own torch.ops.npu here, not the emulation's",
                allow_module_level=True)


@pytest.fixture(scope="module")
def torch_npu():
    ops.register()
    module = types.ModuleType("torch_npu")
    ops.attach(module)
    return module


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


# ---------------------------------------------------------------- registration and export


def test_each_op_has_op_plugins_schema_verbatim_and_body_defaults_equal_the_schemas(torch_npu):
    assert SOURCE["repo"] == "Ascend/op-plugin" and len(SOURCE["commit"]) == 40
    assert set(ops.register()) == set(SCHEMAS)  # idempotent: a second call defines nothing new and fails nothing
    for name, schema in SCHEMAS.items():
        overload = getattr(torch.ops.npu, name).default
        assert str(overload._schema) == f"npu::{schema.func}"
        # the dispatcher leaves out kwargs the caller did not pass: the body's own defaults must be the schema's
        body = inspect.signature(getattr(ops, name)).parameters
        for arg in overload._schema.arguments:
            if arg.has_default_value():
                assert body[arg.name].default == arg.default_value, (name, arg.name)
        assert list(body) == [a.name for a in overload._schema.arguments]


def test_attach_exports_the_op_packets_as_torch_npu_does(torch_npu):
    op = torch_npu.npu_sparse_flash_attention
    assert op is torch.ops.npu.npu_sparse_flash_attention
    assert isinstance(op, torch._ops.OpOverloadPacket)
    assert str(inspect.signature(op)).startswith("(*args")  # what glm5/kernels.py once inspected
    assert torch_npu.npu_lightning_indexer is torch.ops.npu.npu_lightning_indexer
    assert not hasattr(torch_npu, "_dir") and not hasattr(torch_npu, "name")


# ---------------------------------------------------------------- npu_sparse_flash_attention


def sfa_loop_reference(q, q_rope, k, k_rope, idx, scale, block, lq, lkv, mode):
    """op-plugin's cpu_sparse_flash_attention for one batch, one query at a time: gather the selected blocks'
    tokens up to L_kv, mask j > (L_kv - L_q) + i with -1e12 under mode 3, softmax, times the keys' nope part."""
    out = torch.zeros(lq, q.shape[1], 512)
    for i in range(lq):
        tokens = []
        for b in idx[i, 0].tolist():
            if b == -1:
                break
            tokens += [t for t in range(b * block, (b + 1) * block) if t < lkv]
        keys = torch.cat((k, k_rope), -1)[tokens, 0].float()
        s = torch.cat((q[i], q_rope[i]), -1).float() @ keys.T * scale
        if mode == 3:
            s[:, [n for n, t in enumerate(tokens) if t > lkv - lq + i]] = -1e12
        out[i] = torch.softmax(s, -1) @ k[tokens, 0].float()
    return out


def sfa_inputs(t=9, heads=4, t_kv=None, topk=5, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    t_kv = t if t_kv is None else t_kv
    q = torch.randn(t, heads, 576, generator=gen).to(dtype)
    kv = torch.randn(t_kv, 1, 576, generator=gen).to(dtype)
    return q[..., :512].contiguous(), q[..., 512:].contiguous(), kv[..., :512].contiguous(), kv[..., 512:].contiguous()


def random_selection(n_q, n_blocks, topk, lq, lkv, block, seed):
    """Per query: up to ``topk`` distinct blocks the query may see (some rows shorter), -1 padding last."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.full((n_q, 1, topk), -1, dtype=torch.int32)
    for i in range(n_q):
        visible = (lkv - lq + i) // block + 1
        chosen = torch.randperm(min(visible, n_blocks), generator=gen)[: 1 + i % topk]
        idx[i, 0, : len(chosen)] = chosen.to(torch.int32)
    return idx


@pytest.mark.parametrize("mode", [3, 0])
@pytest.mark.parametrize("block", [1, 2])
def test_sparse_attention_tnd_two_batches_matches_the_loop_reference(torch_npu, mode, block):
    lq, lkv = [4, 5], [6, 7]  # per batch; the kv longer than the queries: the causal limit shifts
    q, q_rope, k, k_rope = sfa_inputs(t=sum(lq), t_kv=sum(lkv), heads=2)
    idx = torch.cat([random_selection(n, -(-m // block), 3, n, m, block, seed=b)
                     for b, (n, m) in enumerate(zip(lq, lkv))])
    out, smax, ssum = torch_npu.npu_sparse_flash_attention(
        q, k, k, idx, 0.07, actual_seq_lengths_query=i32([4, 9]), actual_seq_lengths_kv=i32([6, 13]),
        query_rope=q_rope, key_rope=k_rope, sparse_block_size=block, layout_query="TND", layout_kv="TND",
        sparse_mode=mode, attention_mode=2, return_softmax_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert smax.shape == ssum.shape == (1, 9, 2) and smax.dtype == torch.float32
    for (qs, qe), (ks, ke) in (((0, 4), (0, 6)), ((4, 9), (6, 13))):
        ref = sfa_loop_reference(q[qs:qe], q_rope[qs:qe], k[ks:ke], k_rope[ks:ke], idx[qs:qe], 0.07, block,
                                 qe - qs, ke - ks, mode)
        torch.testing.assert_close(out[qs:qe].float(), ref, rtol=1e-2, atol=1e-2)  # bf16 output


def test_sparse_attention_selecting_every_key_is_causal_attention_and_its_statistics_are_the_lse(torch_npu):
    """Every key selected, sparse_mode 3: plain causal softmax attention; max + ln(sum) = logsumexp of the
    scaled scores (the convention slime's lse is derived from)."""
    t, heads = 8, 4
    q, q_rope, k, k_rope = sfa_inputs(t=t, heads=heads, dtype=torch.float16)
    idx = torch.arange(t, dtype=torch.int32).expand(t, t).reshape(t, 1, t).contiguous()
    out, smax, ssum = torch_npu.npu_sparse_flash_attention(
        q, k, k, idx, 0.05, actual_seq_lengths_query=i32([t]), actual_seq_lengths_kv=i32([t]), query_rope=q_rope,
        key_rope=k_rope, layout_query="TND", layout_kv="TND", sparse_mode=3, attention_mode=2,
        return_softmax_lse=True)
    qf, kf = torch.cat((q, q_rope), -1).float(), torch.cat((k, k_rope), -1)[:, 0].float()
    scores = torch.einsum("thd,nd->htn", qf, kf) * 0.05
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    dense = torch.einsum("htn,nd->thd", torch.softmax(scores, -1), k[:, 0].float())
    torch.testing.assert_close(out.float(), dense, rtol=2e-3, atol=2e-3)  # fp16 output
    lse = (smax + ssum.log()).reshape(t, heads)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).T, rtol=1e-5, atol=1e-5)


def test_sparse_attention_bsnd_and_paged_kv_agree_with_tnd(torch_npu):
    lq, lkv, s1, s2, block_size = [3, 4], [5, 6], 4, 6, 16
    q, q_rope, k, k_rope = sfa_inputs(t=sum(lq), t_kv=sum(lkv), heads=2, seed=3)
    idx = torch.cat([random_selection(n, m, 3, n, m, 1, seed=7 + b) for b, (n, m) in enumerate(zip(lq, lkv))])
    common = dict(query_rope=q_rope, key_rope=k_rope, attention_mode=2, sparse_mode=3)
    tnd, _, _ = torch_npu.npu_sparse_flash_attention(
        q, k, k, idx, 0.1, actual_seq_lengths_query=i32([3, 7]), actual_seq_lengths_kv=i32([5, 11]),
        layout_query="TND", layout_kv="TND", **common)

    def pad(x, lengths, s):  # TND -> BSND, zero padded
        parts, start = [], 0
        for n in lengths:
            part = torch.zeros(s, *x.shape[1:], dtype=x.dtype)
            part[:n] = x[start:start + n]
            parts.append(part)
            start += n
        return torch.stack(parts)

    bsnd_args = (pad(q, lq, s1), pad(k, lkv, s2), pad(k, lkv, s2), pad(idx, lq, s1))
    bsnd_kw = dict(common, query_rope=pad(q_rope, lq, s1), key_rope=pad(k_rope, lkv, s2))
    bsnd, _, _ = torch_npu.npu_sparse_flash_attention(*bsnd_args, 0.1, actual_seq_lengths_query=i32(lq),
                                                      actual_seq_lengths_kv=i32(lkv), **bsnd_kw)
    # paged: each batch's keys in one 16-token block, the blocks stored in reverse order
    pages = torch.zeros(2, block_size, 1, 512, dtype=k.dtype)
    rope_pages = torch.zeros(2, block_size, 1, 64, dtype=k.dtype)
    pages[1, :5], pages[0, :6], rope_pages[1, :5], rope_pages[0, :6] = k[:5], k[5:], k_rope[:5], k_rope[5:]
    paged, _, _ = torch_npu.npu_sparse_flash_attention(
        bsnd_args[0], pages, pages, bsnd_args[3], 0.1, block_table=i32([[1], [0]]),
        actual_seq_lengths_query=i32(lq), actual_seq_lengths_kv=i32(lkv), layout_query="BSND", layout_kv="PA_BSND",
        **dict(bsnd_kw, key_rope=rope_pages))
    for b, (start, n) in enumerate(((0, 3), (3, 4))):
        torch.testing.assert_close(bsnd[b, :n], tnd[start:start + n], rtol=0, atol=0)
        torch.testing.assert_close(paged[b, :n], tnd[start:start + n], rtol=0, atol=0)
        assert not bsnd[b, n:].any()  # rows past the batch's query length


def _sfa_call(**change):
    q, q_rope, k, k_rope = sfa_inputs(t=6, heads=4)
    idx = torch.arange(6, dtype=torch.int32).reshape(6, 1, 1).contiguous()
    call = dict(query=q, key=k, value=k, sparse_indices=idx, scale_value=0.1,
                actual_seq_lengths_query=i32([6]), actual_seq_lengths_kv=i32([6]), query_rope=q_rope,
                key_rope=k_rope, layout_query="TND", layout_kv="TND", sparse_mode=3, attention_mode=2)
    for name, fn in change.items():
        call[name] = fn(call[name]) if callable(fn) else fn
    return call


def _strided(x):
    """The same values, not contiguous (a slice of a wider tensor, as q[..., :512] is)."""
    wide = torch.cat((x, x), -1)
    return wide[..., : x.shape[-1]]


@pytest.mark.parametrize("change, match", [
    ({"query": _strided}, "query is not contiguous"),
    ({"query_rope": _strided}, "query_rope is not contiguous"),
    ({"sparse_indices": _strided}, "sparse_indices is not contiguous"),
    ({"key": _strided, "value": _strided}, "key is not contiguous"),
    ({"key_rope": _strided}, "key_rope is not contiguous"),
    ({"query": lambda x: x.float()}, "query has dtype torch.float32"),
    ({"query": lambda x: x.half()}, "must share one dtype"),
    ({"sparse_indices": lambda x: x.long()}, "sparse_indices has dtype torch.int64"),
    ({"query": lambda x: x[..., :256].contiguous()}, "D of query, key and value must be 512"),
    ({"query": lambda x: x[:, :3].contiguous(), "query_rope": lambda x: x[:, :3].contiguous()},
     "query heads N1 must be"),
    ({"key": lambda x: torch.cat((x, x), 1), "value": lambda x: torch.cat((x, x), 1),
      "key_rope": lambda x: torch.cat((x, x), 1)}, "KV_N"),
    ({"value": lambda x: x + 1}, "key and value must share"),
    ({"attention_mode": 0}, "attention_mode supports only 2"),
    ({"query_rope": None}, "needs query_rope and key_rope"),
    ({"sparse_mode": 1}, "sparse_mode supports 0 and 3"),
    ({"sparse_block_size": 3}, "power of 2"),
    ({"pre_tokens": 2048}, "only the default"),
    ({"sinks": torch.zeros(4)}, "do not support sinks"),
    ({"layout_kv": "BSND"}, "must equal layout_query"),
    ({"layout_query": "BSH"}, "only support BSND and TND"),
    ({"actual_seq_lengths_query": None}, "required when the query layout is TND"),
    ({"actual_seq_lengths_kv": None}, "required when the key layout is TND"),
    ({"actual_seq_lengths_query": lambda x: x.long()}, "1-D int32"),
    ({"sparse_indices": i32([[[-1, 0]]] * 6)}, "valid values first"),
    ({"sparse_indices": i32([[[-2]]] * 6)}, "below -1"),
    ({"sparse_indices": torch.zeros(6, 1, 0, dtype=torch.int32)}, "sparse_indices is empty"),
    ({"layout_kv": "PA_BSND", "key": lambda x: x.reshape(1, 6, 1, 512), "value": lambda x: x.reshape(1, 6, 1, 512),
      "key_rope": lambda x: x.reshape(1, 6, 1, 64)}, "block_table is required"),
])
def test_sparse_attention_refuses_what_the_docs_rule_out(torch_npu, change, match):
    with pytest.raises(RuntimeError, match=match) as info:
        torch_npu.npu_sparse_flash_attention(**_sfa_call(**change))
    assert str(info.value).startswith("npu_sparse_flash_attention: ") and "\n" not in str(info.value)


def test_sparse_attention_refuses_the_softmax_statistics_under_paged_kv(torch_npu):
    q, q_rope, k, k_rope = sfa_inputs(t=4, heads=2)
    pages, rope_pages = torch.zeros(1, 16, 1, 512, dtype=k.dtype), torch.zeros(1, 16, 1, 64, dtype=k.dtype)
    with pytest.raises(RuntimeError, match="return_softmax_lse=True is supported only when layout_kv is not PA"):
        torch_npu.npu_sparse_flash_attention(
            q, pages, pages, torch.zeros(4, 1, 1, dtype=torch.int32), 0.1, block_table=i32([[0]]),
            actual_seq_lengths_query=i32([4]), actual_seq_lengths_kv=i32([4]), query_rope=q_rope,
            key_rope=rope_pages, layout_query="TND", layout_kv="PA_BSND", attention_mode=2, return_softmax_lse=True)


# ---------------------------------------------------------------- npu_lightning_indexer


def indexer_inputs(t=7, heads=8, t_k=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t_k = t if t_k is None else t_k
    q = torch.randn(t, heads, 128, generator=gen).bfloat16()
    k = torch.randn(t_k, 1, 128, generator=gen).bfloat16()
    w = torch.randn(t, heads, generator=gen).bfloat16()
    return q, k, w


def indexer_loop_reference(q, k, w, lq, lk, count, mode):
    """One query at a time: score_j = sum_h w_h relu(q_h . k_j); the top ``count`` visible keys by score (the
    lower position first on equal scores), -1 after them."""
    out = torch.full((lq, count), -1, dtype=torch.int32)
    for i in range(lq):
        visible = range(lk) if mode == 0 else range(min(lk, lk - lq + i + 1))
        score = {j: float((w[i].float() * (q[i].float() @ k[j, 0].float()).clamp_min(0)).sum()) for j in visible}
        ranked = sorted(score, key=lambda j: (-score[j], j))[:count]
        out[i, : len(ranked)] = i32(ranked)
    return out


@pytest.mark.parametrize("mode", [3, 0])
def test_indexer_tnd_two_batches_matches_the_loop_reference(torch_npu, mode):
    lq, lk = [3, 4], [5, 9]
    q, k, w = indexer_inputs(t=7, t_k=14)
    idx, values = torch_npu.npu_lightning_indexer(
        q, k, w, actual_seq_lengths_query=i32([3, 7]), actual_seq_lengths_key=i32([5, 14]), layout_query="TND",
        layout_key="TND", sparse_count=6, sparse_mode=mode, return_value=True)
    assert idx.shape == values.shape == (7, 1, 6) and idx.dtype == torch.int32 and values.dtype == torch.bfloat16
    assert torch.equal(idx[:3, 0], indexer_loop_reference(q[:3], k[:5], w[:3], 3, 5, 6, mode))
    assert torch.equal(idx[3:, 0], indexer_loop_reference(q[3:], k[5:], w[3:], 4, 9, 6, mode))
    assert torch.isinf(values[idx == -1]).all() and torch.isfinite(values[idx >= 0]).all()
    assert (values[..., :-1] >= values[..., 1:]).all()  # highest first


def test_indexer_ties_go_to_the_lower_position_and_paged_keys_agree(torch_npu):
    q, k, w = indexer_inputs(t=4, heads=2, seed=1)
    k[2] = k[0]  # keys 0 and 2 score the same for every query
    idx, empty = torch_npu.npu_lightning_indexer(
        q, k, w, actual_seq_lengths_query=i32([4]), actual_seq_lengths_key=i32([4]), layout_query="TND",
        layout_key="TND", sparse_count=4, sparse_mode=0)
    assert empty.numel() == 0
    for row in idx[:, 0].tolist():
        assert row.index(0) < row.index(2)
    pages = torch.zeros(3, 16, 1, 128, dtype=k.dtype)
    pages[2, :4] = k
    paged, _ = torch_npu.npu_lightning_indexer(
        q, pages, w, actual_seq_lengths_query=i32([4]), actual_seq_lengths_key=i32([4]), block_table=i32([[2]]),
        layout_query="TND", layout_key="PA_BSND", sparse_count=4, sparse_mode=0)
    assert torch.equal(paged, idx)


@pytest.mark.parametrize("change, match", [
    (dict(query=lambda q: _strided(q)), "query is not contiguous"),
    (dict(key=lambda k: _strided(k)), "key is not contiguous"),
    (dict(weights=lambda w: w.t().contiguous().t()), "weights is not contiguous"),
    (dict(query=lambda q: torch.cat([q] * 9, 1)[:, :65].contiguous(), weights=lambda w: torch.zeros(7, 65).bfloat16()),
     "at most 64"),
    (dict(query=lambda q: q[..., :64].contiguous(), key=lambda k: k[..., :64].contiguous()), "D of query and key"),
    (dict(weights=lambda w: w.half()), "must be float32 or the query's dtype"),
    (dict(key=lambda k: k.half()), "share one dtype"),
    (dict(sparse_count=3000), "sparse_count supports"),
    (dict(sparse_count=0), "greater than 0"),
    (dict(sparse_mode=2), "sparse_mode supports 0 and 3"),
    (dict(next_tokens=0), "only the default"),
    (dict(layout_key="BSND"), "must equal layout_query"),
    (dict(actual_seq_lengths_query=i32([5, 3])), "prefix sum"),
])
def test_indexer_refuses_what_the_docs_rule_out(torch_npu, change, match):
    q, k, w = indexer_inputs()
    call = dict(query=q, key=k, weights=w, actual_seq_lengths_query=i32([7]), actual_seq_lengths_key=i32([7]),
                layout_query="TND", layout_key="TND", sparse_count=4)
    for name, fn in change.items():
        call[name] = fn(call[name]) if callable(fn) else fn
    with pytest.raises(RuntimeError, match=match) as info:
        torch_npu.npu_lightning_indexer(**call)
    assert str(info.value).startswith("npu_lightning_indexer: ") and "\n" not in str(info.value)


def test_the_bodies_run_on_the_dispatcher_not_as_python_functions(torch_npu):
    """The packet dispatches (a TorchDispatchMode sees the overload), so a device tensor subclass reaches the
    body through __torch_dispatch__ the same way."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    q, k, w = indexer_inputs()
    with Record():
        torch_npu.npu_lightning_indexer(q, k, w, actual_seq_lengths_query=i32([7]),
                                        actual_seq_lengths_key=i32([7]), layout_query="TND", layout_key="TND",
                                        sparse_count=2)
    assert torch.ops.npu.npu_lightning_indexer.default in seen


DEVICE_SCRIPT = r"""
import torch
from slime_ascend.npu_emulation import install
torch_npu = install()
assert torch_npu.npu_lightning_indexer is torch.ops.npu.npu_lightning_indexer
gen = torch.Generator().manual_seed(0)
q = torch.randn(5, 4, 128, generator=gen).bfloat16()
k = torch.randn(5, 1, 128, generator=gen).bfloat16()
w = torch.randn(5, 4, generator=gen).bfloat16()
lengths = torch.tensor([5], dtype=torch.int32)
kw = dict(layout_query="TND", layout_key="TND", sparse_count=3)
host, _ = torch_npu.npu_lightning_indexer(q, k, w, actual_seq_lengths_query=lengths, actual_seq_lengths_key=lengths,
                                          **kw)
on_npu, _ = torch_npu.npu_lightning_indexer(q.npu(), k.npu(), w.npu(), actual_seq_lengths_query=lengths.npu(),
                                            actual_seq_lengths_key=lengths.npu(), **kw)
assert on_npu.device.type == "npu" and torch.equal(on_npu.cpu(), host)
wide = torch.cat((q, q), -1).npu()
try:
    torch_npu.npu_lightning_indexer(wide[..., :128], k.npu(), w.npu(), actual_seq_lengths_query=lengths.npu(),
                                    actual_seq_lengths_key=lengths.npu(), **kw)
except RuntimeError as e:
    print("refused:", e)
"""


def test_the_ops_run_on_the_emulated_npu_device_and_refuse_a_non_contiguous_npu_tensor():
    from conftest import run_python

    done = run_python(DEVICE_SCRIPT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == ("refused: npu_lightning_indexer: query is not contiguous (the op does not "
                                   "support a non-contiguous query): pass query.contiguous()")


# ---------------------------------------------------------------- npu_fusion_attention


@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND", "BNSD"])
def test_fusion_attention_is_causal_sdpa_in_every_layout_with_gqa(torch_npu, layout):
    """transformers' Ascend flash attention imports it; sparse_mode 3 (bottom-right causal, the compressed
    2048 x 2048 mask) against torch's SDPA, MHA and GQA."""
    torch.manual_seed(0)
    b, n, nkv, sq, d = 2, 4, 2, 5, 8
    q, k, v = torch.randn(b, n, sq, d), torch.randn(b, nkv, sq, d), torch.randn(b, nkv, sq, d)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            is_causal=True, scale=0.3)

    def pack(x):
        if layout == "BNSD":
            return x.contiguous()
        bsnd = x.transpose(1, 2).contiguous()
        if layout == "BSND":
            return bsnd
        bsh = bsnd.reshape(b, sq, -1)
        return bsh if layout == "BSH" else bsh.transpose(0, 1).contiguous()

    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    out, softmax_max, softmax_sum, reserved, seed, offset, numels = torch_npu.npu_fusion_attention(
        pack(q), pack(k), pack(v), n, layout, atten_mask=mask, scale=0.3, sparse_mode=3)
    assert out.shape == pack(q).shape and softmax_max.shape == softmax_sum.shape == (b, n, sq, 8)
    assert reserved.numel() == 0 and (seed, offset, numels) == (0, 0, 0)
    torch.testing.assert_close(out, pack(want), rtol=1e-5, atol=1e-5)
    # the statistics: row max and sum of exp(score - max), their log-sum-exp the scores' own
    scores = torch.matmul(q, k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
    scores = scores.masked_fill(torch.triu(torch.ones(sq, sq, dtype=torch.bool), 1), float("-inf"))
    torch.testing.assert_close(softmax_max[..., 0] + softmax_sum[..., 0].log(), scores.logsumexp(-1))


def test_fusion_attention_sparse_mode_0_takes_the_mask_as_given_and_2_aligns_top_left(torch_npu):
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    top_left = torch.triu(torch.ones(3, 6, dtype=torch.bool), diagonal=1)
    given = torch_npu.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=top_left, sparse_mode=0)[0]
    compressed = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    mode2 = torch_npu.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=compressed, sparse_mode=2)[0]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~top_left, scale=1.0)
    torch.testing.assert_close(given, want)
    torch.testing.assert_close(mode2, want)
    full = torch_npu.npu_fusion_attention(q, k, v, 2, "BNSD")[0]  # no mask: every key
    torch.testing.assert_close(full, torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0))


@pytest.mark.parametrize("change, match", [
    ({"input_layout": "TND"}, "input_layout TND \\(varlen\\) is not emulated"),
    ({"keep_prob": 0.9}, "dropout .* is not emulated"),
    ({"sparse_mode": 4}, "sparse_mode 4 is not emulated"),
    ({"head_num": 3}, "head_num 3 does not match query's 2 heads"),
    ({"value": torch.zeros(1, 2, 5, 4)}, "key and value must have one shape"),
    ({"key": torch.zeros(1, 2, 6, 4, dtype=torch.float16)}, "query, key and value must share a dtype"),
    ({"atten_mask": torch.zeros(3, 5, dtype=torch.bool)}, "atten_mask has shape \\(3, 5\\)"),
    ({"atten_mask": torch.zeros(3, 6, dtype=torch.float32)}, "atten_mask has dtype torch.float32"),
    ({"atten_mask": torch.ones(3, 6, dtype=torch.bool)}, "atten_mask masks every key of a query row \\(not emulated"),
])
def test_fusion_attention_refuses_what_the_docs_or_the_emulation_rule_out(torch_npu, change, match):
    args = {"query": torch.zeros(1, 2, 3, 4), "key": torch.zeros(1, 2, 6, 4), "value": torch.zeros(1, 2, 6, 4),
            "head_num": 2, "input_layout": "BNSD", **change}
    with pytest.raises(RuntimeError, match=f"npu_fusion_attention: {match}"):
        torch_npu.npu_fusion_attention(args.pop("query"), args.pop("key"), args.pop("value"), args.pop("head_num"),
                                       args.pop("input_layout"), **args)

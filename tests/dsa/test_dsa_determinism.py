"""``dsa-determinism``: slime's real DSA indexer module selects with the deterministic top-k.

slime's ``slime_plugins/models/glm5/ops/indexer.py`` imports its tilelang kernels at module level, and
tilelang (like deep_gemm) does not exist on a CPU host. The tests therefore import slime's **real**
module with its two kernel modules (``tilelang_indexer_fwd`` / ``_bwd``) replaced by plain-torch
references of the same interface (logits = sum over heads of relu(q.k) * w, -inf outside [start, end);
the backward by autograd on the gathered scores). Everything else (``IndexerFunction``,
``lighting_indexer``, ``pytorch_topk_with_invalid_padding``, ``generate_varlen_mask_params``) is slime's
code, and ``--freeze-indexer`` is slime's ``model_provider.freeze_model_params``. ``glm5.py`` itself
(TransformerEngine, SGLang kernels) is not imported here: it reaches the selection only through
``lighting_indexer``.
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from slime_ascend import _import_hooks, patch
from slime_ascend.algorithms.dsa_topk import deterministic_topk
from slime_ascend.patch.base import PatchTargetError

pytestmark = pytest.mark.slime

INDEXER = "slime_plugins.models.glm5.ops.indexer"
OPS = "slime_plugins.models.glm5.ops"
PATCH_ID = "train.dsa_deterministic_topk"
SGLANG_PATCH_ID = "engine.sglang_dsa_deterministic_topk"
SGLANG_TOPK = "sglang.srt.layers.attention.dsa.dsa_topk_backend"


def ref_logits(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[T, H, D], [S, D], [T, H] -> [T, S] fp32: sum_h relu(q[t, h] . k[s]) * w[t, h] (the tilelang kernel)."""
    s = torch.einsum("thd,sd->ths", q.float(), k.float())
    return (s.clamp(min=0) * w.float()[..., None]).sum(1)


def indexer_fwd_interface(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=True):
    logits = ref_logits(q, kv, weights)
    if clean_logits:
        pos = torch.arange(kv.shape[0])[None, :]
        keep = (pos >= cu_seqlen_ks.long()[:, None]) & (pos < cu_seqlen_ke.long()[:, None])
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits


def indexer_bwd_interface(index_q, weights, index_k, topk_indices, grad_scores):
    q = index_q.detach().float().requires_grad_()
    w = weights.detach().float().requires_grad_()
    k = index_k.detach().float().requires_grad_()
    valid = topk_indices >= 0
    with torch.enable_grad():
        scores = ref_logits(q, k, w).gather(-1, topk_indices.clamp(min=0).long())
        torch.autograd.backward(scores, torch.where(valid, grad_scores.float(), 0.0))
    return q.grad.to(index_q.dtype), w.grad, k.grad


def _stub_tilelang_kernels(monkeypatch):
    """slime's tilelang kernel modules replaced by the plain-torch stand-ins; slime's indexer module
    forgotten, so its next import is fresh."""
    fwd = types.ModuleType(f"{OPS}.tilelang_indexer_fwd")
    fwd.indexer_fwd_interface = indexer_fwd_interface
    bwd = types.ModuleType(f"{OPS}.tilelang_indexer_bwd")
    bwd.indexer_bwd_interface = indexer_bwd_interface
    monkeypatch.setitem(sys.modules, fwd.__name__, fwd)
    monkeypatch.setitem(sys.modules, bwd.__name__, bwd)
    monkeypatch.delitem(sys.modules, INDEXER, raising=False)


@pytest.fixture
def indexer(monkeypatch):
    """slime's real indexer module, imported fresh with the tilelang kernel modules stubbed; unpatched after."""
    _stub_tilelang_kernels(monkeypatch)
    monkeypatch.delenv("MEGATRON_USE_SGLANG_FP8_INDEXER", raising=False)
    module = importlib.import_module(INDEXER)
    assert module.indexer_fwd_interface is indexer_fwd_interface  # slime's module, our kernel stand-ins
    yield module
    patch.get(PATCH_ID).remove()
    _import_hooks.clear(INDEXER)
    sys.modules.pop(INDEXER, None)


def tied_inputs(seed: int = 0, seqs=(7, 9), heads: int = 2, dim: int = 4):
    """Packed sequences whose keys repeat (equal scores) and whose relu zeros tie at the threshold."""
    g = torch.Generator().manual_seed(seed)
    total = sum(seqs)
    base = torch.randn(3, dim, generator=g)
    k = base[torch.randint(0, 3, (total,), generator=g)]  # only 3 distinct keys: ties everywhere
    q = torch.randn(total, heads, dim, generator=g)
    w = torch.randn(total, heads, 1, generator=g)
    cu = torch.tensor([0, *torch.tensor(seqs).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, w, cu


def test_patched_selection_is_the_deterministic_topk_in_slimes_layout(indexer):
    q, k, w, cu = tied_inputs()
    starts, ends = indexer.generate_varlen_mask_params(cu)
    topk = 6
    before_s, before_i = indexer.lighting_indexer(q, k, w, starts.int(), ends.int(), topk)

    patch.install(PATCH_ID)
    assert indexer.pytorch_topk_with_invalid_padding.__slime_ascend_patch__ == PATCH_ID
    after_s, after_i = indexer.lighting_indexer(q, k, w, starts.int(), ends.int(), topk)

    # the output contract of slime's function is kept: shapes, dtypes, -1 / -inf padding
    assert after_i.shape == before_i.shape == (q.shape[0], topk)
    assert after_i.dtype == before_i.dtype == torch.int32
    assert after_s.dtype == before_s.dtype and after_s.shape == before_s.shape
    logits = indexer_fwd_interface(q, k, w.squeeze(-1), starts, ends)
    want_s, want_i = deterministic_topk(logits, topk, index_dtype=torch.int32)
    thr = want_s[:, -1:]
    straddle = torch.isfinite(thr[:, 0]) & ((logits == thr).sum(-1) > (want_s == thr).sum(-1))
    assert straddle.sum() >= 3  # equal scores on both sides of the k-th place: ties decide the set
    assert torch.equal(after_i, want_i)
    assert torch.equal(after_s, want_s)  # slime re-gathers the scores of the selected keys
    # the first query of each sequence sees one key: the rest is -1 padding with -inf scores
    first = after_i[cu[:-1].long()]
    assert (first[:, 1:] == -1).all() and torch.isneginf(after_s[cu[:-1].long(), 1:]).all()
    # the same number of valid keys as torch.topk's selection; ties resolved to the lowest indices
    assert torch.equal((after_i >= 0).sum(-1), (before_i >= 0).sum(-1))
    valid_scores = torch.where(after_i >= 0, after_s, torch.zeros_like(after_s))
    assert torch.equal(valid_scores.sort(-1).values, torch.where(before_i >= 0, before_s, 0.0).sort(-1).values)


def test_same_selection_every_call_and_thread_count(indexer):
    patch.install(PATCH_ID)
    q, k, w, cu = tied_inputs(seed=1, seqs=(40, 25))
    starts, ends = indexer.generate_varlen_mask_params(cu)
    first = indexer.lighting_indexer(q, k, w, starts.int(), ends.int(), 16)[1]
    before = torch.get_num_threads()
    try:
        for threads in (1, max(2, before)):
            torch.set_num_threads(threads)
            assert torch.equal(indexer.lighting_indexer(q, k, w, starts.int(), ends.int(), 16)[1], first)
    finally:
        torch.set_num_threads(before)


def test_nan_logits_are_refused_after_the_patch(indexer, monkeypatch):
    patch.install(PATCH_ID)
    logits = torch.tensor([[0.5, float("nan"), 0.25]])
    with pytest.raises(ValueError, match="NaN"):
        indexer.pytorch_topk_with_invalid_padding(logits, 2)
    # slime's own short-context case (its tests/test_glm5_indexer_short_context.py), now deterministic
    scores, indices = indexer.pytorch_topk_with_invalid_padding(torch.tensor([[0.5, float("-inf"), 0.25]]), 5)
    assert indices.tolist() == [[0, 2, -1, -1, -1]] and indices.dtype == torch.int32
    assert scores[0, :2].tolist() == [0.5, 0.25] and torch.isneginf(scores[0, 2:]).all()


def test_index_replay_does_not_call_the_selection(indexer):
    patch.install(PATCH_ID)
    q, k, w, cu = tied_inputs()
    starts, ends = indexer.generate_varlen_mask_params(cu)
    given = torch.full((q.shape[0], 3), -1, dtype=torch.int32)
    given[:, 0] = 0
    _, idx = indexer.lighting_indexer(q, k, w, starts.int(), ends.int(), 3, given)
    assert torch.equal(idx, given)


class _IndexerAttention(torch.nn.Module):
    """The GLM-5 layout of the indexer parameters (glm5.py's ``_INDEXER_SUBMODULE_NAMES``) in an attention."""

    def __init__(self, hidden=8, heads=2, dim=4):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.linear_q_down_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.wq_b = torch.nn.Linear(hidden, heads * dim, bias=False)
        self.wk = torch.nn.Linear(hidden, dim, bias=False)
        self.k_norm = torch.nn.LayerNorm(dim)
        self.weights_proj = torch.nn.Linear(hidden, heads, bias=False)

    def forward(self, indexer, x, starts, ends, topk):
        qr = self.linear_q_down_proj(x)
        index_q = self.wq_b(qr).view(-1, self.heads, self.dim)
        index_k = self.k_norm(self.wk(x))
        weights = self.weights_proj(x).unsqueeze(-1)
        scores, idx = indexer.lighting_indexer(index_q, index_k, weights, starts.int(), ends.int(), topk)
        return torch.softmax(scores, -1), idx


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attention = _IndexerAttention()


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([_Layer()])


def test_freeze_indexer_keeps_working(indexer):
    """slime's --freeze-indexer (model_provider.freeze_model_params) with the patch: the indexer's parameters
    stay frozen and get no gradient, the selection is the one before freezing, the rest still trains."""
    from slime.backends.megatron_utils.model_provider import freeze_model_params

    patch.install(PATCH_ID)
    torch.manual_seed(0)
    model = _Model()
    attn = model.decoder.layers[0].self_attention
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 8, generator=g)[torch.tensor([0, 1, 1, 2, 0, 3, 3, 4, 1, 0, 2, 2])]  # repeated rows: ties
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    starts, ends = indexer.generate_varlen_mask_params(cu)
    _, before = attn(indexer, x, starts, ends, 4)

    args = types.SimpleNamespace(only_train_params_name_list=None, freeze_params_name_list=None, freeze_indexer=True)
    freeze_model_params(model, args)
    frozen = set(model._slime_frozen_indexer_param_names)
    indexer_names = {n for n, _ in model.named_parameters() if n.split(".")[4] in ("wq_b", "wk", "k_norm", "weights_proj")}
    assert frozen == indexer_names and frozen
    for name, p in model.named_parameters():
        assert p.requires_grad == (name not in frozen), name

    probs, after = attn(indexer, x.requires_grad_(), starts, ends, 4)
    assert torch.equal(after, before)
    assert torch.equal(after, attn(indexer, x, starts, ends, 4)[1])  # and stays so
    (probs.nan_to_num(0.0) * torch.arange(4.0)).sum().backward()
    for name, p in model.named_parameters():
        if name in frozen:
            assert p.grad is None and not p.requires_grad, name
    assert attn.linear_q_down_proj.weight.grad is not None  # the indexer's input still trains
    assert x.grad is not None


def test_plugin_installs_it_when_slimes_indexer_is_imported(monkeypatch):
    from slime_ascend.dsa.plugin import PLUGIN
    from slime_ascend.startup import patch_plan

    _stub_tilelang_kernels(monkeypatch)
    try:
        # the train side's, and SGLang's in its own processes (as its DSA top-k module is imported)
        assert sorted(patch_plan.install_at_process_start([PLUGIN])) == [SGLANG_PATCH_ID, PATCH_ID]
        module = importlib.import_module(INDEXER)
        assert getattr(module.pytorch_topk_with_invalid_padding, "__slime_ascend_patch__", None) == PATCH_ID
        assert module.pytorch_topk_with_invalid_padding.__wrapped__.__module__ == INDEXER
        assert patch.get(PATCH_ID).check({INDEXER: module}) == []  # re-checkable once applied
    finally:
        for pid, target in ((PATCH_ID, INDEXER), (SGLANG_PATCH_ID, SGLANG_TOPK)):
            if patch.get(pid).applied:
                patch.get(pid).remove()
            _import_hooks.clear(target)
        sys.modules.pop(INDEXER, None)


def test_target_is_checked_and_fails_loudly():
    p = patch.get(PATCH_ID)
    assert p.verify() == []  # the real module where importable, else slime's source file on this host
    fake = types.ModuleType(INDEXER)

    def pytorch_topk_with_invalid_padding(logits, topk):
        scores, indices = torch.topk(logits, topk, dim=-1, sorted=False)
        return scores, indices

    class IndexerFunction:
        @staticmethod
        def forward(ctx, logits, topk):
            return pytorch_topk_with_invalid_padding(logits, topk)

    fake.pytorch_topk_with_invalid_padding = pytorch_topk_with_invalid_padding
    fake.IndexerFunction = IndexerFunction
    fake.lighting_indexer = lambda *a: None
    with pytest.raises(PatchTargetError, match="no longer contains"):
        p.install(modules={INDEXER: fake})
    assert fake.pytorch_topk_with_invalid_padding is pytorch_topk_with_invalid_padding  # nothing half-applied
    del fake.IndexerFunction
    with pytest.raises(PatchTargetError, match="IndexerFunction is missing"):
        p.install(modules={INDEXER: fake})


def test_source_check_of_slimes_file():
    from slime_ascend.patch.train import dsa_deterministic_topk as mod

    path = mod._source_file()
    assert path is not None and path.name == "indexer.py"
    text = path.read_text()
    assert mod._source_problems(text, "indexer.py") == []
    changed = text.replace("torch.topk(logits, selected, dim=-1)", "torch.topk(logits, selected, dim=-1, sorted=False)")
    assert any("torch.topk(logits, selected, dim=-1)" in pr for pr in mod._source_problems(changed, "indexer.py"))

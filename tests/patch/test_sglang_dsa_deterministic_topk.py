"""``engine.sglang_dsa_deterministic_topk`` on the installed SGLang: its DSA indexer's torch top-k backend selects
by the ``dsa-determinism`` rule (the train side's, ``slime_ascend.dsa.indexer``), SGLang's layout kept (row-local
indices, ``-1`` padding, keys outside a row's range never); unpatched it does not on tie-heavy scores."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang.srt.layers.attention.dsa.dsa_topk_backend", reason="SGLang with the DSA indexer")

from slime_ascend import patch  # noqa: E402
from slime_ascend.dsa.indexer import topk_with_invalid_padding  # noqa: E402

TOPK = 64


def _scores(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ReLU'd scores rounded to a few values (ties at 0 and elsewhere), each row its own [start, start + length)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.relu(torch.randn(8, 200, generator=g)).round(decimals=1)
    starts = torch.randint(0, 50, (8,), generator=g, dtype=torch.int32)
    lengths = torch.randint(1, 150, (8,), generator=g, dtype=torch.int32)
    return scores, lengths, starts


def _train_side(scores, lengths, starts) -> torch.Tensor:
    """The train side's selection of the same keys (slime's layout: -1 for keys it cannot select), row-local."""
    cols = torch.arange(scores.shape[1])
    valid = (cols >= starts[:, None]) & (cols < (starts + lengths)[:, None])
    _, indices = topk_with_invalid_padding(scores.masked_fill(~valid, float("-inf")), TOPK)
    return torch.where(indices >= 0, indices - starts[:, None], indices)


def test_the_torch_backend_selects_as_the_train_side():
    from sglang.srt.layers.attention.dsa import dsa_topk_backend as m

    torch_backend = m.DSATopKBackend.TORCH
    p = patch.get("engine.sglang_dsa_deterministic_topk")
    assert p.verify() == []
    differed = 0
    for seed in range(5):
        scores, lengths, starts = _scores(seed)
        expected = _train_side(scores, lengths, starts)
        before = torch_backend.topk_func(scores, lengths, TOPK, row_starts=starts)
        differed += int((before.sort(-1).values != expected.sort(-1).values).any())
        p.install()
        try:
            after = torch_backend.topk_func(scores, lengths, TOPK, row_starts=starts)
            unfused = torch_backend.topk_transform(scores, lengths, TOPK, None, None, row_starts=starts,
                                                   force_unfused_topk=True)
        finally:
            p.remove()
        assert after.dtype == torch.int32 and torch.equal(after, expected.to(torch.int32)), seed
        assert torch.equal(unfused, after)
        assert ((after == -1) | ((after >= 0) & (after < lengths[:, None]))).all()  # row-local, in range
    assert differed > 0  # torch.topk chose other keys among the ties: the patch is what makes them equal
    assert getattr(m._topk_unfused, "__slime_ascend_patch__", None) is None  # removed


def test_another_topk_op_is_sglangs_own():
    from sglang.srt.layers.attention.dsa import dsa_topk_backend as m

    calls = []

    def op(x, k, dim=-1):
        calls.append(k)
        return torch.topk(x, k, dim=dim)

    p = patch.get("engine.sglang_dsa_deterministic_topk")
    p.install()
    try:
        scores, lengths, starts = _scores(0)
        m._topk_unfused(scores, lengths, TOPK, row_starts=starts, topk_op=op, topk_op_kwargs={"dim": -1})
    finally:
        p.remove()
    assert calls == [TOPK]


def test_a_nan_score_is_refused():
    from sglang.srt.layers.attention.dsa import dsa_topk_backend as m

    scores, lengths, starts = _scores(1)
    scores[0, int(starts[0])] = float("nan")
    p = patch.get("engine.sglang_dsa_deterministic_topk")
    p.install()
    try:
        with pytest.raises(ValueError, match="NaN"):
            m.DSATopKBackend.TORCH.topk_func(scores, lengths, TOPK, row_starts=starts)
    finally:
        p.remove()


def test_the_plugin_warns_where_slimes_sglang_engines_select_by_a_kernel():
    import types

    from slime_ascend.dsa.checks import sglang_selection_problem

    sglang = types.SimpleNamespace(sglang_dsa_topk_backend="sgl-kernel")
    assert "'sgl-kernel' top-k backend (fused)" in sglang_selection_problem(sglang, environ={})
    torch_fused = types.SimpleNamespace(sglang_dsa_topk_backend="torch")
    assert "Fix: --sglang-dsa-topk-backend torch" in sglang_selection_problem(torch_fused, environ={})
    assert sglang_selection_problem(torch_fused, environ={"SGLANG_DSA_FUSE_TOPK": "false"}) is None
    external = types.SimpleNamespace(rollout_external_engine_addrs=["h:1"])
    assert sglang_selection_problem(external, environ={}) is None
    engine = types.SimpleNamespace(ascend_plugins="cpu,torch-engine,dsa-determinism")
    assert sglang_selection_problem(engine, environ={}) is None

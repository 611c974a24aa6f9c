"""slime_ascend.cpu.cp_attention: each CP rank's causal attention over a THD-packed batch, in slime's zig-zag and
--allgather-cp layouts, against a slow dense reference on the un-split stream (outputs and gradients).

The split in these tests is written from slime's own code, independently of the module's index arithmetic:
zig-zag is ``cp_utils.slice_with_cp`` per sequence (``data.get_batch``: chunks r and 2*cp-1-r of each sequence,
sequences concatenated), --allgather-cp is ``torch.cat(sequences).chunk(cp)[r]``.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from slime_ascend.cpu.cp_attention import cp_causal_attention, global_positions

CP = 2


def dense_reference(q, k, v, bounds):
    """Causal attention of each segment of the un-split stream: explicit scores, -inf above the diagonal and
    across segments, softmax (float64). Tokens past the last boundary: zeros."""
    t, heads, dim = q.shape
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    v = v.repeat_interleave(heads // v.shape[1], dim=1)
    seg = torch.full((t,), -1)
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        seg[s:e] = i
    idx = torch.arange(t)
    allowed = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None]) & (seg[:, None] >= 0)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.nan_to_num(torch.softmax(scores, dim=-1))  # rows of padding: all -inf -> zeros
    return torch.einsum("hqk,khd->qhd", weights, v)


def split(x, layout, bounds, rank, cp=CP):
    """slime's split of a global packed stream ``x`` (dim 0) for CP rank ``rank``."""
    if layout == "allgather":
        return x.chunk(cp, dim=0)[rank]
    parts = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        chunks = x[s:e].chunk(2 * cp, dim=0)
        parts += [chunks[rank], chunks[2 * cp - 1 - rank]]
    return torch.cat(parts)


def lengths_for(layout, raw, cp=CP):
    """Segment lengths as slime builds them: zig-zag pads each sequence to a multiple of 2*cp, allgather pads the
    stream (one padding segment) to a multiple of cp."""
    if layout == "zigzag":
        return [-(-n // (2 * cp)) * 2 * cp for n in raw]
    pad = -sum(raw) % cp
    return raw + ([pad] if pad else [])


def _bounds(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _leaves(t, heads, kv_heads, dim, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t, h, dim, generator=g, dtype=torch.float64, requires_grad=True)
            for h in (heads, kv_heads, kv_heads)]


def run_all_ranks(q, k, v, layout, bounds, cp=CP):
    """Every rank's output from the in-process split; the all-gather hands each rank the others' pieces."""
    local = [[split(x, layout, bounds, r, cp) for x in (q, k, v)] for r in range(cp)]
    kv = [torch.cat([lk, lv], dim=1) for _, lk, lv in local]
    outs = []
    for r, (lq, lk, lv) in enumerate(local):
        def gather(x, r=r):
            assert torch.equal(x, kv[r])
            return [x if i == r else kv[i] for i in range(cp)]
        outs.append(cp_causal_attention(lq, lk, lv, torch.tensor(bounds, dtype=torch.int32), layout=layout,
                                        cp_rank=r, cp_size=cp, all_gather=gather))
    return outs


CASES = [([3, 5, 1], (4, 2), 0), ([7], (2, 1), 1), ([1, 2, 9, 5], (4, 4), 2), ([6, 4, 3], (2, 2), 3)]


@pytest.mark.parametrize("layout", ["zigzag", "allgather"])
@pytest.mark.parametrize("raw,heads_kv,seed", CASES)
def test_every_rank_equals_the_dense_reference_then_split(layout, raw, heads_kv, seed):
    bounds = _bounds(lengths_for(layout, raw))
    q, k, v = _leaves(bounds[-1], *heads_kv, 8, seed)
    ref = dense_reference(q, k, v, bounds)
    outs = run_all_ranks(q, k, v, layout, bounds)
    for r, out in enumerate(outs):
        torch.testing.assert_close(out, split(ref, layout, bounds, r), rtol=0, atol=1e-12)
    # gradients: the same scalar loss through the CP ranks and through the reference
    w = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    cp_loss = sum((out * split(w, layout, bounds, r)).sum() for r, out in enumerate(outs))
    for got, want in zip(torch.autograd.grad(cp_loss, (q, k, v)), ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_segment_straddling_ranks_and_the_padding_tail():
    """allgather: stream of 9 tokens + 1 padding token past cu_seqlens[-1]; the 7-token segment spans both ranks."""
    bounds = [0, 2, 9]
    q, k, v = _leaves(10, 2, 1, 4, 5)
    ref = dense_reference(q, k, v, bounds)
    outs = run_all_ranks(q, k, v, "allgather", bounds)
    torch.testing.assert_close(torch.cat(outs), ref, rtol=0, atol=1e-12)
    assert torch.equal(outs[1][-1], torch.zeros_like(outs[1][-1]))


def test_global_positions_by_hand():
    # zig-zag, segments of 8 and 4 (chunks of 2 and 1): rank 0 holds positions 0 1 6 7 | 0 3, rank 1 2 3 4 5 | 1 2
    assert global_positions("zigzag", [0, 8, 12], 6, 0, 2)[1].tolist() == [0, 1, 6, 7, 0, 3]
    assert global_positions("zigzag", [0, 8, 12], 6, 1, 2)[1].tolist() == [2, 3, 4, 5, 1, 2]
    assert global_positions("zigzag", [0, 8, 12], 6, 1, 2)[0].tolist() == [0, 0, 0, 0, 1, 1]
    # allgather, segments of 3 and 4, one token past the end: rank 0 holds 0 1 2 0, rank 1 1 2 3 -
    assert global_positions("allgather", [0, 3, 7], 4, 0, 2)[1].tolist() == [0, 1, 2, 0]
    segment, position = global_positions("allgather", [0, 3, 7], 4, 1, 2)
    assert (segment.tolist(), position.tolist()) == ([1, 1, 1, -1], [1, 2, 3, -1])


def test_one_rank_is_plain_packed_causal_attention():
    bounds = [0, 3, 8]
    q, k, v = _leaves(10, 4, 2, 8, 9)
    out = cp_causal_attention(q, k, v, bounds, layout="zigzag", cp_rank=0, cp_size=1, all_gather=None)
    torch.testing.assert_close(out, dense_reference(q, k, v, bounds), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kwargs,match", [
    (dict(layout="ring", cp_rank=0, cp_size=2), "layout must be one of"),
    (dict(layout="zigzag", cp_rank=2, cp_size=2), "cp_rank"),
    (dict(layout="zigzag", cp_rank=0, cp_size=2, cu=[0, 6]), "divisible by 2 \\* cp_size = 4"),
    (dict(layout="allgather", cp_rank=0, cp_size=2, cu=[0, 9]), "past the 4 x 2 tokens"),
    (dict(layout="allgather", cp_rank=0, cp_size=2, gather=False), "all_gather callable"),
])
def test_bad_layout_input_is_one_clear_error(kwargs, match):
    q, k, v = _leaves(4, 2, 2, 4, 0)
    cu = kwargs.pop("cu", [0, 8])
    gather = None if kwargs.pop("gather", True) is False else (lambda x: [x, x])
    with pytest.raises(ValueError, match=match):
        cp_causal_attention(q, k, v, cu, all_gather=gather, **kwargs)


# -- two processes over gloo, with torch.distributed.nn's autograd all-gather (backward: a reduce-scatter) -----

def _worker(rank, layout, bounds, port, path):
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_gather

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=CP)
    try:
        q, k, v = _leaves(bounds[-1], 4, 2, 8, 11)
        w = torch.randn(q.shape, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
        local = [split(x, layout, bounds, rank).detach().requires_grad_() for x in (q, k, v)]
        out = cp_causal_attention(*local, bounds, layout=layout, cp_rank=rank, cp_size=CP,
                                  all_gather=lambda x: list(all_gather(x)))
        (out * split(w, layout, bounds, rank)).sum().backward()
        torch.save({"out": out.detach(), "grads": [x.grad for x in local]}, f"{path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["zigzag", "allgather"])
def test_two_gloo_processes_match_the_reference(layout, tmp_path):
    import zygote

    bounds = _bounds(lengths_for(layout, [5, 2, 7]))
    zygote.spawn(_worker, args=(layout, bounds, zygote.free_port(), str(tmp_path / "r")), nprocs=CP)
    q, k, v = _leaves(bounds[-1], 4, 2, 8, 11)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    ref = dense_reference(q, k, v, bounds)
    grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for r in range(CP):
        got = torch.load(tmp_path / f"r.{r}")
        torch.testing.assert_close(got["out"], split(ref, layout, bounds, r), rtol=0, atol=1e-12)
        for g, want in zip(got["grads"], grads):  # the gathered keys' gradients came back summed over ranks
            torch.testing.assert_close(g, split(want, layout, bounds, r), rtol=0, atol=1e-12)

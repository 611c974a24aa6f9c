"""opd's top-k loss term under slime's ``--allgather-cp`` (each CP rank a contiguous piece of the packed stream):
two gloo processes, slime's own ``get_responses`` and ``get_sum_of_sample_mean``, against the one-rank term and
logits gradient of the same micro-batch; plus the response ranges by hand."""

from __future__ import annotations

import argparse
import json
import os
import socket

import pytest
import torch

from slime_ascend.algorithms.cp import allgather_response_range, allgather_to_zigzag, cp_slice
from slime_ascend.algorithms.opd import pack_topk_payload

V, K, CP = 11, 3, 2
TOTALS, RESPS, COEFS = [5, 7, 6], [3, 5, 4], [1.0, 0.5, 1.0]  # 18 tokens: sample 1 straddles the two ranks


def test_allgather_response_ranges_by_hand():
    # stream of 18 tokens, 9 per rank; sample 1 starts at 5, its response logits sit at 6..10 (entries 0..4)
    assert allgather_response_range(0, 9, 5, 7, 5) == (0, 3)  # logits 6, 7, 8
    assert allgather_response_range(1, 9, 5, 7, 5) == (3, 5)  # logits 9, 10
    assert allgather_response_range(1, 9, 0, 5, 3) == (0, 0)  # sample 0 (logits 1..3) is all on rank 0
    assert allgather_response_range(0, 9, 12, 6, 4) == (0, 0)  # sample 2 (logits 13..16) is all on rank 1


def test_allgather_to_zigzag_moves_each_entry_to_its_zigzag_rank():
    full = [torch.arange(n, dtype=torch.float64) + 10 * i for i, n in enumerate(RESPS)]
    starts = [0, 5, 12]
    ranges = [[allgather_response_range(r, 9, s, t, n) for s, t, n in zip(starts, TOTALS, RESPS)] for r in range(CP)]
    pieces = [[x[lo:hi] for x, (lo, hi) in zip(full, ranges[r])] for r in range(CP)]
    padded = []
    for r in range(CP):  # what each rank contributes to the all-reduce, summed here
        padded.append(torch.cat([torch.nn.functional.pad(p, (lo, n - hi))
                                 for p, (lo, hi), n in zip(pieces[r], ranges[r], RESPS)]))
    total = sum(padded)
    for r in range(CP):
        got = allgather_to_zigzag(pieces[r], ranges[r], TOTALS, RESPS, r, CP, lambda x: total)
        want = [cp_slice(x, r, CP, t, n) for x, t, n in zip(full, TOTALS, RESPS)]
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def _batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, sum(TOTALS), V, generator=g)
    tokens, metadata, masks = [], [], []
    for t, r, coef in zip(TOTALS, RESPS, COEFS):
        tokens.append(torch.randint(0, V, (t,), generator=g))
        t_lp, ids = torch.log_softmax(torch.randn(r, V, generator=g), -1).topk(K, dim=-1)
        metadata.append({"opd_teacher": "t", "opd_coef": coef, "opd_topk": pack_topk_payload(ids, t_lp)})
        masks.append(torch.tensor([1] * (r - 1) + [0], dtype=torch.int))
    return {"unconcat_tokens": tokens, "total_lengths": TOTALS, "response_lengths": RESPS, "loss_masks": masks,
            "metadata": metadata}, logits


def _args(allgather_cp):
    return argparse.Namespace(
        ascend_plugins=["opd"], rollout_temperature=1.0, loss_type="custom_loss",
        custom_loss_function_path="slime_ascend.hooks.loss_function", use_opd=True, opd_type="sglang", opd_kl_coef=0.0,
        opd_teacher_load=None, allgather_cp=allgather_cp, ascend_opd_mode="topk",
        ascend_opd_teachers=[{"name": "t", "checkpoint_dir": "/x", "domains": ["d"], "url": "http://h:1"}])


def _stub_mpu(rank, world, group):
    from megatron.core import mpu

    for name, value in (("get_context_parallel_world_size", world), ("get_context_parallel_rank", rank),
                        ("get_tensor_model_parallel_world_size", 1), ("get_tensor_model_parallel_rank", 0)):
        setattr(mpu, name, lambda value=value: value)
    mpu.get_context_parallel_group = lambda: group
    mpu.get_tensor_model_parallel_group = lambda: None


def _term(allgather_cp, batch, logits):
    from slime.backends.megatron_utils.cp_utils import get_sum_of_sample_mean

    from slime_ascend.opd import hooks

    hooks.reset_state()
    reducer = get_sum_of_sample_mean(batch["total_lengths"], batch["response_lengths"], batch["loss_masks"])
    return hooks.opd_topk_loss(_args(allgather_cp), batch, logits, reducer)


def _worker(rank, port, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("SLIME_ASCEND_PLUGINS", None)
    dist.init_process_group("gloo", rank=rank, world_size=CP)
    try:
        _stub_mpu(rank, CP, dist.group.WORLD)
        batch, logits = _batch()
        leaf = logits.clone().requires_grad_(True)
        local = leaf.chunk(CP, dim=1)[rank]  # slime's get_batch: the packed stream cut in CP contiguous pieces
        term, metrics = _term(True, batch, local)
        term.backward()
        grad = leaf.grad.clone()
        dist.all_reduce(grad)  # each rank's gradient lands on its own piece of the stream
        vals = torch.stack([term.detach(), metrics["opd_topk_kl"]])
        dist.all_reduce(vals)  # the ranks' partial sample means add up to the one-rank value
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"vals": vals.tolist(), "grad": grad.tolist()}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slime
def test_two_allgather_cp_ranks_give_the_one_rank_term_and_gradient(fresh_runtime, tmp_path, monkeypatch):
    import zygote

    monkeypatch.delenv("SLIME_ASCEND_PLUGINS", raising=False)
    from megatron.core import mpu

    for name in ("get_context_parallel_world_size", "get_context_parallel_rank", "get_context_parallel_group",
                 "get_tensor_model_parallel_world_size", "get_tensor_model_parallel_rank",
                 "get_tensor_model_parallel_group"):
        monkeypatch.setattr(mpu, name, getattr(mpu, name))  # restored after the one-rank stub below
    _stub_mpu(0, 1, None)
    batch, logits = _batch()
    leaf = logits.clone().requires_grad_(True)
    term, metrics = _term(False, batch, leaf)
    term.backward()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    zygote.spawn(_worker, args=(port, str(tmp_path / "out.json")), nprocs=CP)
    got = json.loads((tmp_path / "out.json").read_text())
    torch.testing.assert_close(torch.tensor(got["vals"]), torch.stack([term.detach(), metrics["opd_topk_kl"]]),
                               rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.tensor(got["grad"]), leaf.grad, rtol=1e-5, atol=1e-7)
    assert float(term.detach()) > 0 and float(leaf.grad.abs().sum()) > 0

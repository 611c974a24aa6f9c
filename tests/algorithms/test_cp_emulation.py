"""CP zig-zag slicing: partition properties, agreement with slime, and GAE via gather/compute/re-slice."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend.algorithms.cp import cp_local_length, cp_response_ranges, cp_slice, cp_unslice
from slime_ascend.algorithms.gae import skip_observation_gae


def ref_owned_indices(cp_rank, cp_size, total_length, response_length):
    """Slow: response index j (logit position P-1+j) is owned by the rank whose zig-zag chunk holds it."""
    P = total_length - response_length
    chunk = -(-total_length // (2 * cp_size))
    mine = {cp_rank, 2 * cp_size - 1 - cp_rank}
    first = [j for j in range(response_length) if (P - 1 + j) // chunk == cp_rank]
    second = [j for j in range(response_length) if (P - 1 + j) // chunk == 2 * cp_size - 1 - cp_rank]
    assert all((P - 1 + j) // chunk in mine for j in first + second)
    return first + second


@settings(max_examples=100, deadline=None)
@given(
    prompt=st.integers(1, 40),
    response=st.integers(0, 120),
    cp_size=st.sampled_from([1, 2, 3, 4, 8]),
)
def test_ranks_partition_the_response(prompt, response, cp_size):
    total = prompt + response
    full = torch.arange(response, dtype=torch.float64) + 0.5
    pieces = [cp_slice(full, r, cp_size, total, response) for r in range(cp_size)]
    owned = torch.cat(pieces).tolist()
    assert sorted(owned) == full.tolist()  # every entry exactly once
    assert sum(cp_local_length(r, cp_size, total, response) for r in range(cp_size)) == response
    torch.testing.assert_close(cp_unslice(pieces, cp_size, total, response), full)
    if cp_size > 1:
        for r in range(cp_size):
            idx = ref_owned_indices(r, cp_size, total, response)
            assert pieces[r].tolist() == [j + 0.5 for j in idx]
    else:
        assert pieces[0].equal(full)


def test_multidim_and_errors():
    full = torch.randn(10, 3)
    pieces = [cp_slice(full, r, 2, 16, 10) for r in range(2)]
    assert pieces[0].shape[1] == 3
    torch.testing.assert_close(cp_unslice(pieces, 2, 16, 10), full)
    assert cp_response_ranges(0, 1, 16, 10) == ((0, 10), (0, 0))
    with pytest.raises(ValueError, match="response_length"):
        cp_slice(torch.zeros(5), 0, 2, 16, 10)
    with pytest.raises(ValueError, match="cp_rank"):
        cp_slice(full, 2, 2, 16, 10)
    with pytest.raises(ValueError, match="prompt"):
        cp_slice(torch.zeros(16), 0, 2, 16, 16)
    with pytest.raises(ValueError, match="one piece per CP rank"):
        cp_unslice(pieces[:1], 2, 16, 10)
    with pytest.raises(ValueError, match="piece of rank 1"):
        cp_unslice([pieces[0], pieces[1][:-1]], 2, 16, 10)


def _slime_cp_utils(monkeypatch, cp_rank, cp_size):
    import slime.backends.megatron_utils.cp_utils as cp_utils

    monkeypatch.setattr(cp_utils.mpu, "get_context_parallel_rank", lambda: cp_rank)
    monkeypatch.setattr(cp_utils.mpu, "get_context_parallel_world_size", lambda: cp_size)
    monkeypatch.setattr(cp_utils.mpu, "get_context_parallel_group", lambda: None)
    return cp_utils


@pytest.mark.slime
@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("prompt,response", [(1, 1), (5, 3), (17, 40), (100, 7), (3, 200), (64, 64)])
def test_matches_slime_slice_and_gather(monkeypatch, cp_size, prompt, response):
    total = prompt + response
    full = torch.randn(response, dtype=torch.float64)
    gathered_parts = []
    for r in range(cp_size):
        cp_utils = _slime_cp_utils(monkeypatch, r, cp_size)
        theirs = cp_utils.slice_log_prob_with_cp(full, total, response)
        ours = cp_slice(full, r, cp_size, total, response)
        assert ours.equal(theirs), (r, ours, theirs)
        if cp_size > 1:
            # slime's all_gather_with_cp places the local piece in a zero vector and all-reduces (sums)
            monkeypatch.setattr(cp_utils.dist.nn, "all_reduce", lambda t, group=None: t)
            gathered_parts.append(cp_utils.all_gather_with_cp(ours, total, response).detach())
    if cp_size > 1:
        pieces = [cp_slice(full, r, cp_size, total, response) for r in range(cp_size)]
        torch.testing.assert_close(cp_unslice(pieces, cp_size, total, response), torch.stack(gathered_parts).sum(0))


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_gae_via_gather_compute_reslice_equals_non_cp(cp_size, seed):
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    B = 4
    prompts = [rnd.randint(1, 50) for _ in range(B)]
    responses = [rnd.choice([1, 2, 9, rnd.randint(10, 300)]) for _ in range(B)]
    totals = [p + r for p, r in zip(prompts, responses, strict=True)]
    masks = [(torch.rand(r, generator=g) < 0.6).float() for r in responses]  # loss_masks stay full
    values = [torch.randn(r, dtype=torch.float64, generator=g) for r in responses]
    rewards = [torch.randn(r, dtype=torch.float64, generator=g) for r in responses]
    lams = [0.9, 0.95, 1.0, 0.5]
    adv_full, ret_full = skip_observation_gae(values, rewards, masks, 0.99, lams)

    # each rank only holds its CP-local values/rewards
    local_v = [[cp_slice(v, r, cp_size, t, n) for v, t, n in zip(values, totals, responses, strict=True)]
               for r in range(cp_size)]
    local_r = [[cp_slice(x, r, cp_size, t, n) for x, t, n in zip(rewards, totals, responses, strict=True)]
               for r in range(cp_size)]
    for rank in range(cp_size):
        # gather (emulated all-gather across ranks) -> compute on full -> re-slice for this rank
        gv = [cp_unslice([local_v[q][i] for q in range(cp_size)], cp_size, totals[i], responses[i]) for i in range(B)]
        gr = [cp_unslice([local_r[q][i] for q in range(cp_size)], cp_size, totals[i], responses[i]) for i in range(B)]
        adv, ret = skip_observation_gae(gv, gr, masks, 0.99, lams)
        for i in range(B):
            a_loc = cp_slice(adv[i], rank, cp_size, totals[i], responses[i])
            r_loc = cp_slice(ret[i], rank, cp_size, totals[i], responses[i])
            assert a_loc.equal(cp_slice(adv_full[i], rank, cp_size, totals[i], responses[i]))
            assert r_loc.equal(cp_slice(ret_full[i], rank, cp_size, totals[i], responses[i]))
            assert a_loc.shape[0] == cp_local_length(rank, cp_size, totals[i], responses[i])

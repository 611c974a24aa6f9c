"""Speculative decoding's accept rule (``slime_ascend.rollout.speculative``): the tokens it keeps follow the target's
distribution exactly (a chi-square test over many seeds on a tiny vocabulary, with its power stated), equal a slow
reference given the same uniforms, and in greedy mode equal the target's own greedy decoding whatever the draft."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend.rollout.speculative import categorical, sampling_distribution, verify

V = 4


def _chain(seed: int, sharp: float) -> torch.Tensor:
    """A Markov chain ``[V, V]``: row ``a`` the distribution of the token after ``a``."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(V, V, generator=g, dtype=torch.float64), dim=-1)


def _speculate(target: torch.Tensor, draft: torch.Tensor, start: int, length: int, k: int, rng: random.Random):
    """``length`` tokens after ``start`` by speculative steps of ``k`` drafts (the draft a chain of its own)."""
    seq = [start]
    while len(seq) - 1 < length:
        drafted, q_rows, prev = [], [], seq[-1]
        for _ in range(k):
            q = draft[prev]
            token = categorical(q, rng.random())
            drafted.append(token)
            q_rows.append(q)
            prev = token
        context = [seq[-1]] + drafted
        p_rows = torch.stack([target[c] for c in context])
        uniforms = torch.tensor([rng.random() for _ in range(k + 1)], dtype=torch.float64)
        seq += verify(p_rows, drafted, torch.stack(q_rows), uniforms)
    return tuple(seq[1 : length + 1])


def test_kept_tokens_follow_the_target_distribution_exactly():
    """Pairs of tokens after a fixed start, from speculative steps of 3 drafts with a draft that disagrees with the
    target (another chain): their frequencies against the target chain's exact pair probabilities. 16 cells (15
    degrees of freedom), 40,000 draws: the test fails at chi-square > 37.7 (alpha = 0.001). Its power: a sampler that
    moves 3% of the mass onto or off one pair has noncentrality at least 40,000 x 0.03^2 = 36 (mean statistic 51), so
    it is caught with probability above one half; keeping every draft token is off by far more (the test below)."""
    target, draft = _chain(0, 1.5), _chain(1, 1.5)
    rng = random.Random(7)
    n = 40_000
    counts: dict[tuple[int, int], int] = {}
    for _ in range(n):
        pair = _speculate(target, draft, 0, 2, 3, rng)
        counts[pair] = counts.get(pair, 0) + 1
    chi2 = 0.0
    for a in range(V):
        for b in range(V):
            expected = n * float(target[0, a] * target[a, b])
            chi2 += (counts.get((a, b), 0) - expected) ** 2 / expected
    assert chi2 < 37.7, (chi2, counts)


def test_a_wrong_rule_is_caught_by_the_same_statistic():
    """The statistic's power, shown: keeping every draft token (no rejection) samples the draft's distribution and
    the same test rejects it by a wide margin."""
    target, draft = _chain(0, 1.5), _chain(1, 1.5)
    rng = random.Random(7)
    n = 40_000
    counts: dict[tuple[int, int], int] = {}
    for _ in range(n):
        a = categorical(draft[0], rng.random())
        b = categorical(draft[a], rng.random())
        counts[(a, b)] = counts.get((a, b), 0) + 1
    chi2 = sum((counts.get((a, b), 0) - n * float(target[0, a] * target[a, b])) ** 2
               / (n * float(target[0, a] * target[a, b])) for a in range(V) for b in range(V))
    assert chi2 > 37.7 * 10, chi2


def _reference(target, drafted, q_rows, uniforms):
    """The rule written out by hand, one token at a time (slow, obviously right)."""
    out = []
    for i, token in enumerate(drafted):
        p, q = float(target[i][token]), float(q_rows[i][token])
        if uniforms[i] < min(1.0, p / q):
            out.append(token)
            continue
        residual = [max(0.0, float(target[i][v]) - float(q_rows[i][v])) for v in range(len(target[i]))]
        if sum(residual) <= 0:
            residual = [float(x) for x in target[i]]
        return out + [_inverse_cdf(residual, uniforms[-1])]
    return out + [_inverse_cdf([float(x) for x in target[-1]], uniforms[-1])]


def _inverse_cdf(weights, u):
    total, acc = sum(weights), 0.0
    for v, w in enumerate(weights):
        acc += w
        if u * total < acc and w > 0:
            return v
    return max(v for v, w in enumerate(weights) if w > 0)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10**6), k=st.integers(1, 5), vocab=st.integers(2, 8))
def test_verify_equals_the_reference_for_fixed_uniforms(seed, k, vocab):
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(2 * torch.randn(k + 1, vocab, generator=g, dtype=torch.float64), dim=-1)
    q_rows = torch.softmax(2 * torch.randn(k, vocab, generator=g, dtype=torch.float64), dim=-1)
    rng = random.Random(seed)
    drafted = [categorical(q_rows[i], rng.random()) for i in range(k)]
    uniforms = [rng.random() for _ in range(k + 1)]
    got = verify(target, drafted, q_rows, torch.tensor(uniforms, dtype=torch.float64))
    assert got == _reference(target.tolist(), drafted, q_rows.tolist(), uniforms)
    assert 1 <= len(got) <= k + 1 and got[:-1] == drafted[: len(got) - 1]


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10**6), k=st.integers(1, 6))
def test_greedy_speculation_gives_the_targets_greedy_tokens_whatever_the_draft(seed, k):
    target, draft = _chain(seed, 3.0), _chain(seed + 1, 3.0)
    greedy = [0]
    for _ in range(12):
        greedy.append(int(torch.argmax(target[greedy[-1]])))
    seq = [0]
    while len(seq) < 13:
        drafted, prev = [], seq[-1]
        for _ in range(k):
            prev = int(torch.argmax(draft[prev]))
            drafted.append(prev)
        rows = torch.stack([target[c] for c in [seq[-1]] + drafted]).log()
        seq += verify(rows, drafted)
    assert seq[:13] == greedy


def test_sampling_distribution_keeps_the_engines_tokens_with_their_tempered_probabilities():
    from slime_ascend.rollout.torch_engine.engine import SamplingConfig, _choose_token

    g = torch.Generator().manual_seed(3)
    for temperature, top_k, top_p, min_p in ((1.0, -1, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, -1, 0.6, 0.0),
                                             (1.0, 8, 0.9, 0.05)):
        logits = 3 * torch.randn(32, generator=g)
        cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                             return_top_p_token_ids=True)
        _, _, kept = _choose_token(logits, cfg, torch.Generator().manual_seed(0), False)
        dist = sampling_distribution(logits, temperature, top_k, top_p, min_p)
        assert sorted(kept) == sorted(torch.nonzero(dist).flatten().tolist())
        tempered = torch.softmax(logits.double() / temperature, dim=-1)[kept]
        assert torch.allclose(dist[kept], tempered / tempered.sum(), atol=1e-12)
        assert math.isclose(float(dist.sum()), 1.0)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="needs 3"):
        verify(torch.zeros(2, 4), [1, 2])
    with pytest.raises(ValueError, match="uniforms"):
        verify(torch.full((2, 4), 0.25), [1], torch.full((1, 4), 0.25))

"""CompactionRL credit: cross-segment GAE (paper identity, slow references, DP split, CP), shared rewards,
and per-rollout normalisation weights."""

from __future__ import annotations

import math
import os
import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend import advantage_base, hooks
from slime_ascend.algorithms.cp import cp_full_vectors, cp_local_length, cp_slice
from slime_ascend.compaction import credit
from slime_ascend.compat.sample import get_sample_class
from slime_ascend.plugins import runtime

# ----------------------------------------------------------------------------------------------
# building rollout_data like slime's trainer sees it
# ----------------------------------------------------------------------------------------------


def make_segments(rng: random.Random, num_rollouts: int, max_segments: int = 4, max_len: int = 12):
    """[(rollout_id, segment_index, prompt_len, mask)] with every segment ending on an action token
    except sometimes the last one (a truncated tail of observations)."""
    out = []
    for rid in range(num_rollouts):
        n = rng.randint(1, max_segments)
        for s in range(n):
            length = rng.randint(1, max_len)
            mask = [1 if rng.random() < 0.6 else 0 for _ in range(length)]
            if s < n - 1:
                mask[-1] = 1  # a segment other than the last ends with the summary (trainable)
            out.append((100 + rid, s, rng.randint(1, 5), mask))
    return out


def make_rollout_data(segments, *, values=None, kl=None, rewards=None, shuffle_seed=None):
    order = list(range(len(segments)))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    segs = [segments[i] for i in order]
    data = {
        "rollout_ids": [s[0] for s in segs],
        "round_number": [s[1] for s in segs],
        "loss_masks": [torch.tensor(s[3], dtype=torch.int32) for s in segs],
        "response_lengths": [len(s[3]) for s in segs],
        "total_lengths": [s[2] + len(s[3]) for s in segs],
        "rewards": [rewards[s[0]] if rewards else 1.0 for s in segs],
        "values": [values[i] for i in order] if values is not None else [torch.zeros(len(s[3])) for s in segs],
        "kl": [kl[i] for i in order] if kl is not None else [torch.zeros(len(s[3])) for s in segs],
    }
    return data, order


def make_args(**kw):
    """slime-like args; forgets validated plugin settings (cached per process, as in slime's actors)."""
    runtime.reset()
    base = dict(ascend_plugins=["compaction"], advantage_estimator="ppo", gamma=1.0, lambd=1.0, kl_coef=0.0,
                custom_advantage_function_path="slime_ascend.hooks.advantage_function")
    base.update(kw)
    return SimpleNamespace(**base)


# ----------------------------------------------------------------------------------------------
# slow references
# ----------------------------------------------------------------------------------------------


def ref_local_gae(values, token_rewards, mask, reward, gamma, lam):
    """Loop GAE over the action tokens of one segment; reward on the last action; bootstrap 0."""
    acts = [j for j, m in enumerate(mask) if m]
    adv = [0.0] * len(mask)
    next_adv = next_v = 0.0
    for k in reversed(range(len(acts))):
        j = acts[k]
        r = token_rewards[j] + (reward if k == len(acts) - 1 else 0.0)
        delta = r + gamma * next_v - values[j]
        next_adv = delta + gamma * lam * next_adv
        adv[j] = next_adv
        next_v = values[j]
    return adv


def ref_n_after(segments):
    out = []
    for rid, s, _, _ in segments:
        out.append(sum(sum(m) for r2, s2, _, m in segments if r2 == rid and s2 > s))
    return out


def ref_distance_to_end(segments):
    """For every token of every segment: trainable tokens after it in the concatenated trajectory
    (None on observation tokens)."""
    out = []
    for rid, s, _, mask in segments:
        later = sum(sum(m) for r2, s2, _, m in segments if r2 == rid and s2 > s)
        dist = []
        for j, m in enumerate(mask):
            dist.append(later + sum(mask[j + 1 :]) if m else None)
        out.append(dist)
    return out


# ----------------------------------------------------------------------------------------------
# cross-segment GAE
# ----------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), gamma=st.floats(0.5, 1.0), lam=st.floats(0.5, 1.0), reward=st.floats(-2, 2))
def test_v0_advantage_is_discounted_distance_to_end_of_concatenated_trajectory(seed, gamma, lam, reward):
    rng = random.Random(seed)
    segments = make_segments(rng, num_rollouts=3)
    data, order = make_rollout_data(segments, rewards={100: reward, 101: reward, 102: reward}, shuffle_seed=seed)
    args = make_args(gamma=gamma, lambd=lam)
    hooks.advantage_function(args, data)
    dist = ref_distance_to_end(segments)
    for pos, i in enumerate(order):
        adv = data["advantages"][pos].tolist()
        for j, d in enumerate(dist[i]):
            expected = 0.0 if d is None else reward * (gamma * lam) ** d
            assert adv[j] == pytest.approx(expected, rel=1e-5, abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0), kl_coef=st.floats(0, 0.5),
       critic_target=st.sampled_from(["decayed", "local"]))
def test_ppo_base_and_decay_match_slow_reference(seed, gamma, lam, kl_coef, critic_target):
    rng = random.Random(seed)
    segments = make_segments(rng, num_rollouts=3)
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(len(s[3]), generator=gen) for s in segments]
    kl = [torch.randn(len(s[3]), generator=gen).abs() for s in segments]
    rewards = {100: 1.0, 101: -0.5, 102: 0.25}
    data, order = make_rollout_data(segments, values=values, kl=kl, rewards=rewards, shuffle_seed=seed + 1)
    args = make_args(gamma=gamma, lambd=lam, kl_coef=kl_coef, ascend_compaction_critic_target=critic_target)
    hooks.advantage_function(args, data)
    n_after = ref_n_after(segments)
    for pos, i in enumerate(order):
        rid, _, _, mask = segments[i]
        local = ref_local_gae(values[i].tolist(), (-kl_coef * kl[i]).tolist(), mask, rewards[rid], gamma, lam)
        f = (gamma * lam) ** n_after[i] if n_after[i] else 1.0
        assert data["compaction_decay"][pos] == pytest.approx(f)
        assert data["advantages"][pos].tolist() == pytest.approx([a * f for a in local], rel=1e-4, abs=1e-5)
        scale = f if critic_target == "decayed" else 1.0
        want_ret = [a * scale + v if m else 0.0 for a, v, m in zip(local, values[i].tolist(), mask)]
        assert data["returns"][pos].tolist() == pytest.approx(want_ret, rel=1e-4, abs=1e-5)
        assert data["trainable_tokens_after"][pos] == n_after[i]
        assert data["rollout_trainable_tokens"][pos] == sum(sum(s[3]) for s in segments if s[0] == rid)
        assert data["gae_lambdas"][pos] == lam


def test_length_adaptive_lambda_is_one_per_rollout():
    segments = [(7, 0, 2, [1, 1, 0, 1]), (7, 1, 2, [1, 0, 1]), (8, 0, 3, [1] * 10)]
    data, _ = make_rollout_data(segments)
    hooks.advantage_function(make_args(lambd=0.3, ascend_compaction_lambda_mode="length_adaptive"), data)
    lam7, lam8 = 1 - 1 / (1.5 * 5), 1 - 1 / (1.5 * 10)
    assert data["gae_lambdas"] == pytest.approx([lam7, lam7, lam8])
    assert data["compaction_decay"] == pytest.approx([lam7**2, 1.0, 1.0])


def test_decay_uses_base_estimator_lambdas_and_rejects_per_segment_lambdas(fresh_runtime):
    segments = [(7, 0, 2, [1, 1]), (7, 1, 2, [1, 1, 1])]
    data, _ = make_rollout_data(segments)
    data["advantages"] = [torch.ones(2), torch.ones(3)]
    data["returns"] = [torch.ones(2), torch.ones(3)]
    data["gae_lambdas"] = [0.5, 0.5]
    args = make_args(gamma=0.8)
    credit.decay_advantages(args, data)
    assert data["compaction_decay"] == pytest.approx([0.4**3, 1.0])
    data["gae_gammas"] = [0.5, 0.5]  # a base estimator with its own gamma (e.g. sao's) overrides args.gamma
    data["advantages"] = [torch.ones(2), torch.ones(3)]
    credit.decay_advantages(args, data)
    assert data["compaction_decay"] == pytest.approx([0.25**3, 1.0])
    assert data["advantages"][0].tolist() == pytest.approx([0.25**3] * 2)
    del data["gae_gammas"]
    data["gae_lambdas"] = [0.5, 0.6]
    data["advantages"] = [torch.ones(2), torch.ones(3)]
    with pytest.raises(ValueError, match="one lambda per rollout"):
        credit.decay_advantages(args, data)


def test_base_is_skipped_when_an_earlier_contribution_set_advantages():
    segments = [(7, 0, 2, [1, 1]), (7, 1, 2, [1, 1, 1])]
    data, _ = make_rollout_data(segments)
    sentinel = [torch.full((2,), 3.0), torch.full((3,), 3.0)]
    data["advantages"], data["returns"] = sentinel, list(sentinel)
    credit.base_advantages(make_args(), data)
    assert data["advantages"] is sentinel


def test_base_is_ppo_only_the_dispatcher_runs_slimes_for_other_estimators():
    segments = [(7, 0, 2, [1, 1]), (7, 1, 2, [0, 1, 1])]
    data, _ = make_rollout_data(segments, rewards={7: 0.75})
    for estimator in ("grpo", "reinforce_plus_plus"):
        credit.base_advantages(make_args(advantage_estimator=estimator), data)
        assert "advantages" not in data  # slime's own, at the chain's base order (tests/slime)
    credit.base_advantages(make_args(advantage_estimator="ppo"), data)
    assert len(data["advantages"]) == 2


def test_several_samples_per_rollout_without_round_number_is_an_error():
    segments = [(7, 0, 2, [1, 1]), (7, 1, 2, [1, 1, 1])]
    data, _ = make_rollout_data(segments)
    del data["round_number"]
    with pytest.raises(ValueError, match="round_number"):
        credit.prepare_segments(make_args(), data)
    single = [(7, 0, 2, [1, 1]), (8, 0, 2, [1, 1, 1])]
    data, _ = make_rollout_data(single)
    del data["round_number"]
    credit.prepare_segments(make_args(), data)
    assert data["trainable_tokens_after"] == [0, 0]


def test_segment_layout_rejects_duplicates_and_non_integer_ids():
    with pytest.raises(ValueError, match="duplicate"):
        credit.segment_layout([1, 1], [0, 0], [2, 3])
    with pytest.raises(TypeError, match="integers"):
        credit.segment_layout(["a"], [0], [2])


# ----------------------------------------------------------------------------------------------
# segments of one rollout on different data-parallel ranks (gloo, 3 processes)
# ----------------------------------------------------------------------------------------------


def _dp_worker(rank, world, port, shards, out_dir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        credit._dp_group = lambda: dist.group.WORLD
        data = shards[rank]
        args = make_args(gamma=0.9, lambd=0.95, ascend_compaction_lambda_mode="length_adaptive")
        credit.prepare_segments(args, data)
        credit.base_advantages(args, data)
        credit.decay_advantages(args, data)
        torch.save({k: data[k] for k in ("advantages", "returns", "compaction_decay", "trainable_tokens_after",
                                         "rollout_trainable_tokens")}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_segments_split_across_dp_ranks_equal_single_rank(tmp_path):
    rng = random.Random(3)
    segments = make_segments(rng, num_rollouts=5, max_segments=4)
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(len(s[3]), generator=gen) for s in segments]
    rewards = {100 + r: float(r) - 2 for r in range(5)}
    whole, order = make_rollout_data(segments, values=values, rewards=rewards)
    args = make_args(gamma=0.9, lambd=0.95, ascend_compaction_lambda_mode="length_adaptive")
    hooks.advantage_function(args, whole)

    # deal segments round-robin after a shuffle, so most rollouts straddle ranks
    world = 3
    idx = list(range(len(segments)))
    random.Random(1).shuffle(idx)
    parts = [idx[r::world] for r in range(world)]
    assert any(len({segments[i][0] for i in p}) < len({segments[i][0] for i in idx}) for p in parts)
    shards = []
    for p in parts:
        d, _ = make_rollout_data([segments[i] for i in p], values=[values[i] for i in p], rewards=rewards)
        shards.append(d)
    import zygote

    zygote.spawn(_dp_worker, args=(world, zygote.free_port(), shards, str(tmp_path)), nprocs=world)
    for r, p in enumerate(parts):
        got = torch.load(tmp_path / f"{r}.pt")
        for k, i in enumerate(p):
            assert got["compaction_decay"][k] == pytest.approx(whole["compaction_decay"][i])
            assert got["trainable_tokens_after"][k] == whole["trainable_tokens_after"][i]
            assert got["rollout_trainable_tokens"][k] == whole["rollout_trainable_tokens"][i]
            torch.testing.assert_close(got["advantages"][k], whole["advantages"][i])
            torch.testing.assert_close(got["returns"][k], whole["returns"][i])


# ----------------------------------------------------------------------------------------------
# context parallelism: CP-local values/kl, full loss masks
# ----------------------------------------------------------------------------------------------


def _padded(fulls, rank, size, totals, resps):
    lens = [[cp_local_length(r, size, t, n) for t, n in zip(totals, resps)] for r in range(size)]
    width = max(sum(row) for row in lens)
    flat = torch.cat([cp_slice(f, rank, size, t, n) for f, t, n in zip(fulls, totals, resps)])
    return torch.nn.functional.pad(flat, (0, width - flat.shape[0]))


@pytest.mark.parametrize("cp_size", [2, 3])
def test_cp_local_base_and_decay_equal_full_computation_sliced(monkeypatch, cp_size):
    rng = random.Random(cp_size)
    segments = make_segments(rng, num_rollouts=3, max_len=20)
    gen = torch.Generator().manual_seed(cp_size)
    values = [torch.randn(len(s[3]), generator=gen) for s in segments]
    kl = [torch.randn(len(s[3]), generator=gen).abs() for s in segments]
    rewards = {100: 1.0, 101: 0.0, 102: -1.0}
    args = make_args(gamma=0.95, lambd=0.9, kl_coef=0.1)
    full, _ = make_rollout_data(segments, values=values, kl=kl, rewards=rewards)
    hooks.advantage_function(args, full)
    totals, resps = full["total_lengths"], full["response_lengths"]
    for rank in range(cp_size):
        local, _ = make_rollout_data(segments, values=values, kl=kl, rewards=rewards)
        local["values"] = [cp_slice(v, rank, cp_size, t, n) for v, t, n in zip(values, totals, resps)]
        local["kl"] = [cp_slice(v, rank, cp_size, t, n) for v, t, n in zip(kl, totals, resps)]

        def gather(x, rank=rank):
            for fulls in (values, kl):
                if torch.equal(x, _padded(fulls, rank, cp_size, totals, resps)):
                    return [_padded(fulls, r, cp_size, totals, resps) for r in range(cp_size)]
            raise AssertionError("gathered an unexpected tensor")

        monkeypatch.setattr(advantage_base, "cp_state", lambda rank=rank, gather=gather: (rank, cp_size, gather))
        hooks.advantage_function(args, local)
        for i, (t, n) in enumerate(zip(totals, resps)):
            torch.testing.assert_close(local["advantages"][i], cp_slice(full["advantages"][i], rank, cp_size, t, n))
            torch.testing.assert_close(local["returns"][i], cp_slice(full["returns"][i], rank, cp_size, t, n))
        assert local["compaction_decay"] == full["compaction_decay"]


def test_cp_full_vectors_reassembles_and_checks_lengths():
    totals, resps = [9, 14, 5], [6, 10, 2]
    fulls = [torch.arange(n, dtype=torch.float32) + 10 * i for i, n in enumerate(resps)]
    for rank in range(2):
        pieces = [cp_slice(f, rank, 2, t, n) for f, t, n in zip(fulls, totals, resps)]
        out = cp_full_vectors(pieces, totals, resps, rank, 2,
                              lambda x: [_padded(fulls, r, 2, totals, resps) for r in range(2)])
        for a, b in zip(out, fulls):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="owns"):
        cp_full_vectors(fulls, totals, resps, 0, 2, lambda x: [x, x])


# ----------------------------------------------------------------------------------------------
# rewards: every segment shares the final reward; a rollout counts once in group normalisation
# ----------------------------------------------------------------------------------------------


def _segment_samples(rollout_id, group, rewards):
    Sample = get_sample_class()
    out = []
    for i, r in enumerate(rewards):
        out.append(Sample(index=rollout_id, group_index=group, rollout_id=rollout_id, reward=r,
                          metadata={"compaction": True, "segment_index": i, "num_segments": len(rewards),
                                    "round_number": i}))
    return out


def test_share_final_reward_copies_last_segment_and_checks_completeness():
    samples = _segment_samples(1, 0, [0.1, 0.2, 0.9]) + [get_sample_class()(index=9, reward=0.3)]
    raw = [s.reward for s in samples]
    raw_out, out = credit.share_final_reward(None, samples, raw, [x * 2 for x in raw])
    assert raw_out == [0.9, 0.9, 0.9, 0.3] and out == [1.8, 1.8, 1.8, 0.6]
    with pytest.raises(ValueError, match="present exactly once"):
        credit.share_final_reward(None, samples[1:], raw[1:], raw[1:])


def test_share_final_reward_reports_the_rollouts_segment_counts(caplog):
    samples = (_segment_samples(1, 0, [0.1, 0.2, 0.9]) + _segment_samples(2, 0, [0.5])
               + [get_sample_class()(index=9, reward=0.3)])
    raw = [s.reward for s in samples]
    with caplog.at_level("INFO", logger="slime_ascend.compaction.credit"):
        credit.share_final_reward(SimpleNamespace(), samples, raw, raw)
    expected = {"rollout/compaction_rollouts": 2.0, "rollout/compaction_segments": 4.0,
                "rollout/compaction_compactions": 2.0, "rollout/compaction_compacted_rollouts": 1.0,
                "rollout/compaction_segments_per_rollout": 2.0, "rollout/compaction_max_segments": 3.0}
    assert credit.segment_counts(samples) == expected
    assert f"compaction -: {expected}" in caplog.text  # outside slime's rollout: no rollout id, no tracker
    assert credit.segment_counts([get_sample_class()(index=9, reward=0.3)])["rollout/compaction_rollouts"] == 0


@pytest.mark.parametrize("splits", [(1, 1, 1), (2, 1, 4), (4, 4, 2)])
def test_group_normalisation_counts_a_rollout_once_however_many_segments(fresh_runtime, splits):
    rewards = [1.0, 0.0, 0.5]
    samples = []
    for rid, (n, r) in enumerate(zip(splits, rewards)):
        samples += _segment_samples(rid, 0, [r] * n)
    args = SimpleNamespace(ascend_plugins=["compaction"], advantage_estimator="grpo", rewards_normalization=True,
                           grpo_std_normalization=True, reward_key=None)
    raw, normed = hooks.reward_post_process(args, samples)
    t = torch.tensor(rewards)
    want = ((t - t.mean()) / (t.std() + 1e-6)).tolist()
    got = {s.rollout_id: v for s, v in zip(samples, normed)}
    assert [got[r] for r in range(3)] == pytest.approx(want, rel=1e-6)
    assert raw == [rewards[s.rollout_id] for s in samples]


# ----------------------------------------------------------------------------------------------
# token-level normalisation: a rollout's weight does not depend on how it is split
# ----------------------------------------------------------------------------------------------


def _split(mask, k):
    cuts = [round(len(mask) * j / k) for j in range(k + 1)]
    return [mask[cuts[j] : cuts[j + 1]] for j in range(k)]


def ref_sum_of_sample_mean(x_per_sample, masks, rollout_ids):
    """slime's reducer, by its documented rule: sum over samples of sum(x*m) / (mask total of the rollout)."""
    totals = {}
    for rid, m in zip(rollout_ids, masks):
        totals[rid] = totals.get(rid, 0) + sum(m)
    return sum(sum(a * b for a, b in zip(x, m)) / max(totals[rid], 1)
               for x, m, rid in zip(x_per_sample, masks, rollout_ids))


@pytest.mark.parametrize("k", [1, 2, 4])
def test_rollout_weight_is_independent_of_segment_count(k):
    rng = random.Random(k)
    mask = [1 if rng.random() < 0.7 else 0 for _ in range(40)]
    x = [rng.uniform(-1, 1) for _ in range(40)]
    parts, xs = _split(mask, k), _split(x, k)
    weight = ref_sum_of_sample_mean([[1.0] * len(p) for p in parts], parts, [0] * k)
    assert weight == pytest.approx(1.0)
    value = ref_sum_of_sample_mean(xs, parts, [0] * k)
    assert value == pytest.approx(sum(a * b for a, b in zip(x, mask)) / sum(mask))
    assert math.isfinite(value)

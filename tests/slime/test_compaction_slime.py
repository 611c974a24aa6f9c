"""CompactionRL on real slime: segments through slime's samples -> train_data conversion and DP split,
slime's per-rollout reducer weights, and slime's advantage path calling our chain."""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from slime_ascend import hooks
from slime_ascend.compaction import credit
from slime_ascend.compaction.generate import CompactionRuntime, CompactionSettings, run_compaction_rollout
from slime_ascend.plugins import runtime

pytestmark = pytest.mark.slime

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compaction"))
from compaction_fakes import FakeEngine, make_tiny_tokenizer, memory_policy  # noqa: E402


def _args(**kw):
    runtime.reset()
    base = dict(ascend_plugins=["compaction"], advantage_estimator="ppo", rewards_normalization=True,
                grpo_std_normalization=False, reward_key=None, n_samples_per_prompt=1, rollout_batch_size=4,
                gamma=0.9, lambd=0.95, kl_coef=0.0,
                custom_advantage_function_path="slime_ascend.hooks.advantage_function",
                ascend_compaction_context_budget=3000, ascend_compaction_trigger_tokens=1200,
                ascend_compaction_env_kwargs={"num_facts": 10})
    base.update(kw)
    return SimpleNamespace(**base)


def _rollouts(args, compactions):
    from slime.utils.types import Sample

    tok = make_tiny_tokenizer()
    out = []
    for i, limit in enumerate(compactions):
        a = SimpleNamespace(**{**vars(args), "ascend_compaction_max_compactions": limit})
        sample = Sample(index=i, group_index=i, prompt="p", metadata={"seed": i})
        segs = asyncio.run(run_compaction_rollout(a, sample, {"max_new_tokens": 400},
                                                  settings=CompactionSettings.from_args(a),
                                                  runtime=CompactionRuntime(tok, FakeEngine(tok, memory_policy))))
        assert len(segs) == limit + 1
        out.append(segs)
    return out


def _stub_manager(args):
    from slime.ray.rollout import RolloutManager

    cls = RolloutManager.__ray_actor_class__
    stub = SimpleNamespace(args=args, custom_convert_samples_to_train_data_func=None,
                           custom_reward_post_process_func=hooks.reward_post_process)
    stub._post_process_rewards = functools.partial(cls._post_process_rewards, stub)
    return cls, stub


def test_segments_survive_slime_conversion(fresh_runtime):
    args = _args()
    rollouts = _rollouts(args, [2, 0, 1, 1])
    samples = [s for segs in rollouts for s in segs]
    cls, stub = _stub_manager(args)
    data = cls._convert_samples_to_train_data(stub, samples)
    assert data["rollout_ids"] == [s.rollout_id for s in samples]
    assert data["round_number"] == [s.metadata["segment_index"] for s in samples]
    assert data["loss_masks"] == [s.loss_mask for s in samples]
    assert data["tokens"] == [s.tokens for s in samples]
    assert data["rollout_log_probs"] == [s.rollout_log_probs for s in samples]
    totals = {i: sum(sum(s.loss_mask) for s in segs) for i, segs in enumerate(rollouts)}
    assert data["rollout_mask_sums"] == [totals[s.rollout_id] for s in samples]
    # ppo: no normalisation; every segment carries its rollout's final reward
    assert data["rewards"] == [segs[-1].reward for segs in rollouts for _ in segs]


def test_slime_default_normalisation_would_mix_rollouts_ours_counts_each_once(fresh_runtime):
    args = _args(advantage_estimator="grpo", n_samples_per_prompt=2, rollout_batch_size=1)
    rollouts = _rollouts(args, [2, 0])
    for segs, r in zip(rollouts, (1.0, 0.0)):
        for s in segs:
            s.group_index, s.reward = 0, r
    samples = [s for segs in rollouts for s in segs]
    cls, stub = _stub_manager(args)
    _, ours = stub._post_process_rewards(samples)
    assert ours == pytest.approx([0.5] * 3 + [-0.5])
    stub.custom_reward_post_process_func = None
    _, slimes = stub._post_process_rewards(samples)  # 4 samples != 2 * 1: whole-batch fallback, per sample
    assert slimes == pytest.approx([0.25] * 3 + [-0.75])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dp_worker(rank, world, port, shards, args, out_dir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        credit._dp_group = lambda: dist.group.WORLD
        data = shards[rank]
        for fn in (credit.prepare_segments, credit.base_advantages, credit.decay_advantages):
            fn(args, data)
        torch.save({k: data[k] for k in ("advantages", "compaction_decay")}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_dp_split_spreads_segments_and_gathered_credit_matches_one_rank(fresh_runtime, monkeypatch, tmp_path):
    import slime.ray.rollout as rollout_mod
    import slime.utils.data as data_mod

    args = _args(global_batch_size=4, use_dynamic_batch_size=False, micro_batch_size=1, balance_by_flops=False,
                 balance_data=False, max_tokens_per_gpu=None, rollout_data_transport="object-store")
    rollouts = _rollouts(args, [2, 1, 1, 0])  # 8 segments: the static path needs a multiple of dp_size
    samples = [s for segs in rollouts for s in segs]
    cls, stub = _stub_manager(args)
    train_data = cls._convert_samples_to_train_data(stub, samples)
    stub.train_parallel_config = {"dp_size": 2, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
    monkeypatch.setattr(rollout_mod, "ray", SimpleNamespace(put=lambda x, **k: x))
    monkeypatch.setattr(data_mod, "ray", SimpleNamespace(get=lambda x: x))
    refs = cls._split_train_data_by_dp(stub, dict(train_data))
    shards = []
    for r in range(2):
        d = data_mod.process_rollout_data(args, refs, r, 2)
        assert set(d) >= {"round_number", "rollout_ids", "loss_masks", "rollout_mask_sums", "total_lengths"}
        for j, pos in enumerate(d["partition"]):
            assert d["round_number"][j] == train_data["round_number"][pos]
            assert d["rollout_ids"][j] == train_data["rollout_ids"][pos]
            assert d["loss_masks"][j].tolist() == train_data["loss_masks"][pos]
        d["values"] = [torch.zeros(len(m)) for m in d["loss_masks"]]
        d["kl"] = [torch.zeros(len(m)) for m in d["loss_masks"]]
        shards.append(d)
    rank_of = {pos: r for r, d in enumerate(shards) for pos in d["partition"]}
    assert any(len({rank_of[p] for p, rid in enumerate(train_data["rollout_ids"]) if rid == x}) == 2
               for x in set(train_data["rollout_ids"])), "no rollout straddles the two ranks"

    whole = {k: train_data[k] for k in ("rollout_ids", "round_number", "rewards", "response_lengths")}
    whole["loss_masks"] = [torch.tensor(m) for m in train_data["loss_masks"]]
    whole["total_lengths"] = [len(t) for t in train_data["tokens"]]
    whole["values"] = [torch.zeros(len(m)) for m in whole["loss_masks"]]
    whole["kl"] = [torch.zeros(len(m)) for m in whole["loss_masks"]]
    for fn in (credit.prepare_segments, credit.base_advantages, credit.decay_advantages):
        fn(args, whole)

    import zygote

    zygote.spawn(_dp_worker, args=(2, _free_port(), shards, args, str(tmp_path)), nprocs=2)
    for r, d in enumerate(shards):
        got = torch.load(tmp_path / f"{r}.pt")
        for j, pos in enumerate(d["partition"]):
            assert got["compaction_decay"][j] == pytest.approx(whole["compaction_decay"][pos])
            torch.testing.assert_close(got["advantages"][j], whole["advantages"][pos])


# ----------------------------------------------------------------------------------------------
# with Megatron's parallel state (single-process gloo)
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def mpu_state():
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.parametrize("per_token", [False, True])
def test_slime_reducer_gives_a_rollout_the_same_weight_for_1_2_4_segments(mpu_state, per_token):
    from slime.backends.megatron_utils.cp_utils import get_sum_of_sample_mean

    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(48, generator=gen) < 0.7).int()
    x = torch.randn(48, generator=gen)
    results = []
    for k in (1, 2, 4):
        parts = list(mask.split(48 // k))
        resp = [len(p) for p in parts]
        total = [n + 3 for n in resp]
        sums = torch.full((k,), float(mask.sum()))  # slime's rollout_mask_sums: the rollout's total per sample
        reducer = get_sum_of_sample_mean(total, resp, parts, sums, calculate_per_token_loss=per_token)
        results.append((float(reducer(torch.ones(48))), float(reducer(x))))
    assert all(r == pytest.approx(results[0], rel=1e-4, abs=1e-5) for r in results)
    if not per_token:
        assert results[0][0] == pytest.approx(1.0)  # each rollout counts once
        assert results[0][1] == pytest.approx(float((x * mask).sum() / mask.sum()))


@pytest.mark.parametrize("estimator", ["grpo", "ppo"])
def test_slime_advantage_path_runs_our_chain(mpu_state, fresh_runtime, estimator):
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns

    args = _args(advantage_estimator=estimator, use_rollout_logprobs=False, use_opd=False, normalize_advantages=False,
                 kl_loss_type="k1", gamma=1.0, lambd=0.5)
    masks = [torch.tensor([1, 0, 1]), torch.tensor([1, 1])]
    data = {"rollout_ids": [3, 3], "round_number": [0, 1], "loss_masks": masks, "rewards": [2.0, 2.0],
            "response_lengths": [3, 2], "total_lengths": [5, 4], "log_probs": [torch.zeros(3), torch.zeros(2)],
            "values": [torch.zeros(3), torch.zeros(2)]}
    compute_advantages_and_returns(args, data)
    assert data["compaction_decay"] == pytest.approx([0.25, 1.0])
    if estimator == "grpo":  # slime's broadcast reward, decayed by (1 * 0.5) ** 2 for the first segment
        assert data["advantages"][0].tolist() == pytest.approx([0.5] * 3)
        assert data["advantages"][1].tolist() == pytest.approx([2.0] * 2)
    else:  # V = 0: R * (gamma*lambda) ** (distance to the end of the concatenated trajectory)
        assert data["advantages"][0].tolist() == pytest.approx([2.0 * 0.5**3, 0.0, 2.0 * 0.5**2])
        assert data["advantages"][1].tolist() == pytest.approx([2.0 * 0.5, 2.0])

"""rollout.forward_metadata on real slime: each DP rank receives its samples' train_metadata."""

import argparse

import pytest

from slime_ascend import patch

pytestmark = pytest.mark.slime


def test_targets_match_this_slime():
    assert patch.get("rollout.forward_metadata").verify() == []
    assert patch.get("train.rollout_log_metadata").verify() == []


def test_split_forwards_metadata_per_partition(monkeypatch):
    import ray
    import slime.ray.rollout as rollout_mod
    from slime_ascend.patch.rollout import forward_metadata as fm

    cls = getattr(rollout_mod.RolloutManager, "__ray_actor_class__", rollout_mod.RolloutManager)
    stored = []
    monkeypatch.setattr(ray, "put", lambda obj, **kw: stored.append(obj) or obj)
    args = argparse.Namespace(global_batch_size=4, micro_batch_size=1, use_dynamic_batch_size=False,
                              max_tokens_per_gpu=None, balance_data=False, rollout_data_transport="object-store",
                              n_samples_per_prompt=1, rollout_batch_size=4, num_steps_per_rollout=None,
                              balance_by_flops=False)
    stub = type("RM", (), {})()
    stub.args = args
    stub.train_parallel_config = {"dp_size": 2, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
    data = {
        "tokens": [[1, 2, 3], [4, 5], [6, 7, 8, 9], [1, 1]],
        "response_lengths": [1, 1, 2, 1], "rewards": [0.0, 1.0, 0.5, 0.2], "raw_reward": [0.0, 1.0, 0.5, 0.2],
        "truncated": [0, 0, 0, 0], "loss_masks": [[1], [1], [1, 1], [1]], "sample_indices": [0, 1, 2, 3],
        "rollout_ids": [0, 1, 2, 3], "metadata": [{"opd_coef": float(i)} for i in range(4)],
    }
    cls._split_train_data_by_dp(stub, dict(data))
    assert len(stored) == 2 and all("metadata" not in d for d in stored)  # slime alone drops it
    stored.clear()
    patch.install("rollout.forward_metadata")
    try:
        cls._split_train_data_by_dp(stub, dict(data))
    finally:
        patch.get("rollout.forward_metadata").remove()
    assert len(stored) == 2
    for rank_data in stored:
        assert rank_data["metadata"] == [{"opd_coef": float(j)} for j in rank_data["partition"]]


def test_train_logger_does_not_see_metadata():
    import slime.observability.train_metric_utils as tm
    from slime_ascend.patch.train import rollout_log_metadata as rlm

    seen = []
    original = tm.log_rollout_data
    patch.install("train.rollout_log_metadata")
    try:
        # call the wrapper around a recording stand-in for slime's function
        wrapped = rlm._wrap_log(lambda rid, args, data: seen.append(sorted(data)))
        data = {"metadata": [{}], "rewards": [1.0]}
        wrapped(0, None, data)
        assert seen == [["rewards"]] and "metadata" in data
        assert tm.log_rollout_data is not original
    finally:
        patch.get("train.rollout_log_metadata").remove()
    assert tm.log_rollout_data is original

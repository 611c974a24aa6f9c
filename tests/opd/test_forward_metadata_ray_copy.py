"""Per-teacher OPD coefficients reach the trainer from a RolloutManager running as a real Ray actor.

Ray runs an actor from a by-value (cloudpickle) copy of its class, whose methods read their globals
from a private dict. The ``rollout.forward_metadata`` patch once wrapped only the module's class and
the module's ``tensorize_rollout_data_for_training``, so in slime's real loop every DP rank's
``rollout_data`` came without ``metadata`` and the opd advantage stopped with "rollout_data carries
no per-sample 'metadata'" (found by tests/e2e/test_slime_opd.py). This reproduces Ray's copy without
starting Ray: the class is copied with a private globals dict, and the instance is registered as this
process's actor the way Ray's worker holds it (``global_worker.actors[actor_id]``).
"""

from __future__ import annotations

import argparse
import types

import pytest

from slime_ascend import patch

pytestmark = pytest.mark.slime


def _ray_copy_instance(monkeypatch):
    ray = pytest.importorskip("ray")
    import slime.ray.rollout as rollout_mod

    module_cls = rollout_mod.RolloutManager.__ray_actor_class__
    # what Ray ships to the actor process: a class of the same name and module whose method is a copy of
    # slime's, reading its globals from a private dict captured when the class was pickled (cloudpickle
    # would hand back the original class inside the process that pickled it, hence the manual copy)
    split = vars(module_cls)["_split_train_data_by_dp"]
    copied_split = types.FunctionType(split.__code__, dict(vars(rollout_mod)), split.__name__, split.__defaults__,
                                      split.__closure__)
    copy_cls = type(module_cls.__name__, (), {"__module__": module_cls.__module__,
                                              "_split_train_data_by_dp": copied_split})

    class ActorClass(copy_cls):  # Ray's worker instantiates a subclass of the copy
        pass

    instance = ActorClass.__new__(ActorClass)
    instance.args = argparse.Namespace(
        global_batch_size=4, micro_batch_size=1, use_dynamic_batch_size=False, max_tokens_per_gpu=None,
        balance_data=False, rollout_data_transport="object-store", n_samples_per_prompt=1, rollout_batch_size=4,
        num_steps_per_rollout=None, balance_by_flops=False)
    instance.train_parallel_config = {"dp_size": 2, "cp_size": 1, "vpp_size": 1,
                                      "microbatch_group_size_per_vp_stage": 1}
    worker = ray._private.worker.global_worker
    monkeypatch.setitem(worker.actors, worker.actor_id, instance)
    stored: list[dict] = []
    monkeypatch.setattr(ray, "put", lambda obj, **kw: stored.append(obj) or obj)
    return instance, copy_cls, stored


DATA = {
    "tokens": [[1, 2, 3], [4, 5], [6, 7, 8, 9], [1, 1]],
    "response_lengths": [1, 1, 2, 1], "rewards": [0.0, 1.0, 0.5, 0.2], "raw_reward": [0.0, 1.0, 0.5, 0.2],
    "truncated": [0, 0, 0, 0], "loss_masks": [[1], [1], [1, 1], [1]], "sample_indices": [0, 1, 2, 3],
    "rollout_ids": [0, 1, 2, 3],
    "metadata": [{"opd_teacher": "math" if i % 2 else "code", "opd_coef": 1.0 if i % 2 else 0.5} for i in range(4)],
}


def test_metadata_reaches_each_rank_from_rays_copy_of_the_rollout_manager(monkeypatch):
    instance, copy_cls, stored = _ray_copy_instance(monkeypatch)
    original = vars(copy_cls)["_split_train_data_by_dp"]
    instance._split_train_data_by_dp(dict(DATA))  # a slime that needs more stub args fails here, never skips
    assert len(stored) == 2 and all("metadata" not in d for d in stored)  # stock slime drops it
    stored.clear()
    patch.install("rollout.forward_metadata")
    try:
        instance._split_train_data_by_dp(dict(DATA))
        assert len(stored) == 2
        for rank_data in stored:
            assert rank_data["metadata"] == [DATA["metadata"][j] for j in rank_data["partition"]]
    finally:
        patch.get("rollout.forward_metadata").remove()
    assert vars(copy_cls)["_split_train_data_by_dp"] is original  # removal restores Ray's copy


def test_outside_an_actor_only_the_module_class_is_patched():
    pytest.importorskip("ray")
    import slime.ray.rollout as rollout_mod

    from slime_ascend.patch.rollout import forward_metadata as fm

    assert fm.live_actor_class(rollout_mod.RolloutManager.__ray_actor_class__) is None

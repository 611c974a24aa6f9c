"""The cpu plugin's Ray capacity check: a job Ray cannot place stops in the driver's parse_args with one line
naming RAY_OVERRIDE_RESOURCES, instead of train.py waiting for ever on a 2-core host."""

from __future__ import annotations

import types

import pytest

from slime_ascend.cpu import ray_capacity
from slime_ascend.plugins.settings import SettingsError


def _args(**kw):
    base = dict(actor_num_nodes=1, actor_num_gpus_per_node=1, rollout_num_gpus=1, rollout_external=True,
                rollout_external_engine_addrs=["127.0.0.1:30000"], colocate=False, debug_train_only=False,
                debug_rollout_only=False)
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.fixture
def no_cluster(monkeypatch):
    """No Ray cluster on this machine to join: ray.init() would start a local one."""
    from ray._private import services

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_OVERRIDE_RESOURCES", raising=False)
    monkeypatch.setattr(services, "get_ray_address_from_environment", lambda addr, temp_dir: None)


@pytest.mark.slime
@pytest.mark.parametrize(("kw", "bundles", "need"), [
    ({}, 1, 1 + 2 + 0.2),  # the job of docs/cpu.md ('Your own job'): one actor device, one external engine
    ({"rollout_external": False, "rollout_external_engine_addrs": None, "rollout_num_gpus": 2}, 3, 3 + 2),
    ({"rollout_external": False, "rollout_external_engine_addrs": None, "colocate": True,
      "actor_num_gpus_per_node": 4, "rollout_num_gpus": 2}, 4, 4 + 2),
    ({"rollout_external_engine_addrs": ["a:1", "b:2"], "actor_num_gpus_per_node": 2}, 2, 2 + 2 + 0.4),
])
def test_demand_follows_slimes_placement_layout(kw, bundles, need):
    """Counted by hand from slime's placement_group.py (one CPU per bundle; RolloutManager 1, its lock 1) and
    external.py (0.2 CPU per external engine handle)."""
    args = _args(**kw)
    assert ray_capacity.placement_bundles(args) == bundles
    assert ray_capacity.demand(args) == pytest.approx(need)


def test_a_two_core_host_without_override_is_refused_in_one_line(no_cluster, monkeypatch):
    import ray
    from ray._private import utils

    monkeypatch.setattr(utils, "get_num_cpus", lambda *a, **k: 2)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(SettingsError) as info:
        ray_capacity.check(_args())
    text = str(info.value)
    assert "\n" not in text
    assert "with 2 logical CPUs, but slime asks for 3.2" in text
    assert "Fix: export RAY_OVERRIDE_RESOURCES='{\"CPU\": 8}'" in text and "ray start --head --num-cpus 8" in text


@pytest.mark.parametrize(("override", "refused"), [('{"CPU": 8}', False), ('{"CPU": 3}', True),
                                                   ('{"CPU": 4, "NPU": 4}', False)])
def test_the_override_is_what_ray_will_advertise(no_cluster, monkeypatch, override, refused):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setenv("RAY_OVERRIDE_RESOURCES", override)
    if refused:
        with pytest.raises(SettingsError, match="slime asks for 3.2"):
            ray_capacity.check(_args())
    else:
        ray_capacity.check(_args())


def test_a_broken_override_is_one_line(no_cluster, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setenv("RAY_OVERRIDE_RESOURCES", "{CPU: 8")
    with pytest.raises(SettingsError, match="RAY_OVERRIDE_RESOURCES=.* is not JSON. Fix: export"):
        ray_capacity.check(_args())


def test_an_existing_cluster_or_a_placed_actor_is_not_second_guessed(monkeypatch):
    import ray
    from ray._private import services

    monkeypatch.setenv("RAY_OVERRIDE_RESOURCES", '{"CPU": 1}')
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # joins that cluster: its resources are its own
    ray_capacity.check(_args())
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(services, "get_ray_address_from_environment", lambda addr, temp_dir: "127.0.0.1:6379")
    ray_capacity.check(_args())  # a `ray start` cluster on this machine
    monkeypatch.setattr(services, "get_ray_address_from_environment", lambda addr, temp_dir: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # inside slime's actors: already placed
    ray_capacity.check(_args())

"""driver.acknowledged_weight_update against slime's real RayTrainGroup: target checked, installs, removes."""

from __future__ import annotations

import types

import pytest

from slime_ascend import patch

pytestmark = pytest.mark.slime


def test_target_matches_slime_and_the_patch_installs_and_removes():
    actor_group = pytest.importorskip("slime.ray.actor_group")
    p = patch.get("driver.acknowledged_weight_update")
    original = actor_group.RayTrainGroup._reload_rollout_weights_from_disk
    assert p.check({"slime.ray.actor_group": actor_group}) == []
    p.install(modules={"slime.ray.actor_group": actor_group})
    try:
        assert actor_group.RayTrainGroup._reload_rollout_weights_from_disk.__wrapped__ is original
    finally:
        p.remove()
    assert actor_group.RayTrainGroup._reload_rollout_weights_from_disk is original and not p.applied


def test_a_changed_target_is_refused_loudly():
    p = patch.get("driver.acknowledged_weight_update")

    class RayTrainGroup:
        def _reload_rollout_weights_from_disk(self, disk_weight_dir, weight_version):
            return "reloads without pausing"

    fake = types.SimpleNamespace(__name__="slime.ray.actor_group", RayTrainGroup=RayTrainGroup)
    problems = p.check({"slime.ray.actor_group": fake})
    assert any("pause_generation" in problem for problem in problems), problems
    with pytest.raises(patch.PatchTargetError):
        p.install(modules={"slime.ray.actor_group": fake})


def test_declared_by_staleness_and_the_sync_plugins_at_actor_group_import():
    from slime_ascend.offpolicy.plugin import STALENESS
    from slime_ascend.weight_sync.plugin import PLUGINS

    for plugin in (STALENESS, *PLUGINS):
        uses = {u.patch: u for u in plugin.patches}
        assert uses["driver.acknowledged_weight_update"].moment == "import:slime.ray.actor_group", plugin.name

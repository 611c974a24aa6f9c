"""driver.resumed_weight_version: against slime's real RayTrainGroup (target checked, installs, removes), and
the version counter it sets on a fake group that resumes at a given rollout."""

from __future__ import annotations

import sys
import types
from argparse import Namespace

import pytest

from slime_ascend import patch
from slime_ascend.patch.driver.resumed_weight_version import _create, pushes_before


@pytest.mark.slime
def test_target_matches_slime_and_the_patch_installs_and_removes():
    import slime.ray.actor_group as actor_group

    p = patch.get("driver.resumed_weight_version")
    original = actor_group.RayTrainGroup.create
    assert p.check({"slime.ray.actor_group": actor_group}) == []
    p.install(modules={"slime.ray.actor_group": actor_group})
    try:
        assert actor_group.RayTrainGroup.create.__wrapped__ is original
    finally:
        p.remove()
    assert actor_group.RayTrainGroup.create is original and not p.applied


@pytest.mark.slime
def test_a_changed_target_is_refused_loudly():
    p = patch.get("driver.resumed_weight_version")

    class RayTrainGroup:
        def __init__(self, args):
            self._disk_weight_version = 0

        def create(self, rollout_manager=None):
            return [0]

    fake = types.SimpleNamespace(__name__="slime.ray.actor_group", RayTrainGroup=RayTrainGroup)
    problems = p.check({"slime.ray.actor_group": fake})
    assert any("update_weight_start_version" in problem for problem in problems), problems
    with pytest.raises(patch.PatchTargetError):
        p.install(modules={"slime.ray.actor_group": fake})


def test_declared_with_the_acknowledged_switch():
    from slime_ascend.offpolicy.plugin import STALENESS
    from slime_ascend.weight_sync.plugin import PLUGINS

    for plugin in (STALENESS, *PLUGINS):
        assert "driver.resumed_weight_version" in plugin.patch_ids, plugin.name


@pytest.mark.parametrize(("start", "script", "interval", "expected"), [
    (0, "train.py", 1, 0), (1, "train.py", 1, 1), (5, "train.py", 3, 5),  # train.py pushes after every step
    (4, "train_async.py", 2, 2), (5, "train_async.py", 2, 3), (3, "train_async.py", 1, 3),
])
def test_pushes_before_the_resumed_rollout(start, script, interval, expected):
    assert pushes_before(start, script, interval) == expected


class _Group:
    """slime's create, reduced: hands the counter to the actors (as update_weight_start_version), which report the
    rollout they resume at."""

    def __init__(self, load, role="actor", start_rollout_id=None, reported=None):
        self.args = Namespace(update_weight_start_version=0, update_weights_interval=1, load=str(load),
                              start_rollout_id=start_rollout_id, ckpt_step=None)
        self.role, self._actor_handlers, self._disk_weight_version = role, [], 0
        self.reported, self.actor_start_version = reported, None

    def create(self, rollout_manager=None):
        self.args.update_weight_start_version = self._disk_weight_version
        self.actor_start_version = self.args.update_weight_start_version  # what each train actor counts from
        self._actor_handlers = ["actor"]
        return [self.reported]


def _megatron_checkpoint(path, step):
    path.mkdir()
    (path / "latest_checkpointed_iteration.txt").write_text(f"{step}\n")
    return path


@pytest.mark.parametrize(("step", "role", "expected"), [(2, "actor", 3), (2, "critic", 0)])
def test_a_resumed_actor_group_counts_on_before_its_actors_start(step, role, expected, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/src/slime/train.py"])
    group = _Group(_megatron_checkpoint(tmp_path / "ckpt", step), role, reported=step + 1)
    assert _create(_Group.create)(group) == [step + 1]
    assert group._disk_weight_version == group.actor_start_version == expected


def test_a_fresh_start_and_an_explicit_start_rollout_id(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])
    fresh = _Group(tmp_path, start_rollout_id=0, reported=1)  # an HF --load: slime set start_rollout_id 0
    _create(_Group.create)(fresh)
    assert fresh._disk_weight_version == 0
    explicit = _Group(_megatron_checkpoint(tmp_path / "ckpt", 2), start_rollout_id=5, reported=3)
    _create(_Group.create)(explicit)
    assert explicit._disk_weight_version == explicit.actor_start_version == 5


def test_a_running_counter_and_a_configured_start_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])
    ckpt = _megatron_checkpoint(tmp_path / "ckpt", 2)
    group = _Group(ckpt, reported=3)
    group._disk_weight_version = 7  # a re-create (--release-train): already counting
    _create(_Group.create)(group)
    assert group._disk_weight_version == 7
    configured = _Group(ckpt, reported=3)
    configured.args.update_weight_start_version = configured._disk_weight_version = 10  # from a config
    _create(_Group.create)(configured)
    assert configured._disk_weight_version == 10


def test_actors_resuming_elsewhere_than_the_checkpoint_says_stop_the_job(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])
    group = _Group(_megatron_checkpoint(tmp_path / "ckpt", 2), reported=1)
    with pytest.raises(RuntimeError, match="expected the train actors to resume at rollout 3 .* they report 1"):
        _create(_Group.create)(group)

"""driver.acknowledged_weight_update: against slime's real RayTrainGroup (target checked, installs, removes),
and its pushes on fake engines, where it deletes only the version directories it wrote, however
``--hf-checkpoint`` and ``--update-weight-disk-dir`` nest."""

from __future__ import annotations

import shutil
import sys
import types
from argparse import Namespace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "weight_sync"))
from _fake_engines import Call, Engine, get  # noqa: E402

from slime_ascend import patch  # noqa: E402
from slime_ascend.patch.driver.acknowledged_weight_update import _reload  # noqa: E402
from slime_ascend.weight_sync import served_version  # noqa: E402


@pytest.mark.slime
def test_target_matches_slime_and_the_patch_installs_and_removes():
    import slime.ray.actor_group as actor_group

    p = patch.get("driver.acknowledged_weight_update")
    original = actor_group.RayTrainGroup._reload_rollout_weights_from_disk
    assert p.check({"slime.ray.actor_group": actor_group}) == []
    p.install(modules={"slime.ray.actor_group": actor_group})
    try:
        assert actor_group.RayTrainGroup._reload_rollout_weights_from_disk.__wrapped__ is original
    finally:
        p.remove()
    assert actor_group.RayTrainGroup._reload_rollout_weights_from_disk is original and not p.applied


@pytest.mark.slime
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


@pytest.mark.slime
def test_declared_by_staleness_and_the_sync_plugins_at_actor_group_import():
    from slime_ascend.offpolicy.plugin import STALENESS
    from slime_ascend.weight_sync.plugin import PLUGINS

    for plugin in (STALENESS, *PLUGINS):
        uses = {u.patch: u for u in plugin.patches}
        assert uses["driver.acknowledged_weight_update"].moment == "import:slime.ray.actor_group", plugin.name


def _write_checkpoint(path: Path, text: str) -> Path:
    """What slime's writer (or a user) leaves in a checkpoint directory."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(text)
    (path / "model.safetensors").write_text(text)
    return path


def _push_versions(monkeypatch, disk_dir: Path, hf_checkpoint: Path, count: int, between=None, **flags) -> list:
    """``count`` disk weight pushes as slime makes them: its writer replaces ``DISK_DIR/weight_vNNNNNN`` and the
    driver's (patched) reload switches the engines; ``between(version)`` runs after each push."""
    fake_ray = types.ModuleType("ray")
    fake_ray.get = get
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    published: list = []
    monkeypatch.setattr(served_version, "publish", published.append)
    engines = [Engine(), Engine()]
    args = Namespace(update_weight_local_checkpoint_dir=None, offload_rollout=False,
                     update_weight_disk_keep_files=False, update_weight_disk_dir=str(disk_dir),
                     hf_checkpoint=str(hf_checkpoint), load=None, ref_load=None, save=None)
    vars(args).update(flags)
    group = types.SimpleNamespace(args=args, _rollout_manager=types.SimpleNamespace(
        get_updatable_engines_and_lock=Call(lambda: (engines, None, 2, [], []))))
    reload = _reload(lambda *a: pytest.fail("slime's own reload runs only with a local checkpoint dir"))
    for version in range(1, count + 1):
        version_dir = disk_dir / f"weight_v{version:06d}"
        shutil.rmtree(version_dir, ignore_errors=True)  # slime's MegatronTrainRayActor writer does this first
        _write_checkpoint(version_dir, f"v{version}")
        reload(group, version_dir, str(version))
        assert [e.version for e in engines] == [str(version)] * 2
        if between is not None:
            between(version)
    return published


NESTINGS = ["apart", "checkpoint_inside_disk_dir", "disk_dir_inside_checkpoint", "equal",
            "disk_dir_is_a_link_to_the_checkpoints_parent", "checkpoint_is_a_link_into_disk_dir"]


def _layout(tmp_path: Path, nesting: str) -> tuple[Path, Path, Path]:
    """(disk dir as passed, --hf-checkpoint as passed, the checkpoint's real directory)."""
    if nesting == "apart":
        return tmp_path / "disk", tmp_path / "hf", tmp_path / "hf"
    if nesting == "checkpoint_inside_disk_dir":
        return tmp_path / "disk", tmp_path / "disk" / "hf", tmp_path / "disk" / "hf"
    if nesting == "disk_dir_inside_checkpoint":
        return tmp_path / "hf" / "updates", tmp_path / "hf", tmp_path / "hf"
    if nesting == "equal":
        return tmp_path / "hf", tmp_path / "hf", tmp_path / "hf"
    if nesting == "disk_dir_is_a_link_to_the_checkpoints_parent":
        (tmp_path / "shared").mkdir()
        (tmp_path / "disk").symlink_to(tmp_path / "shared", target_is_directory=True)
        return tmp_path / "disk", tmp_path / "shared" / "hf", tmp_path / "shared" / "hf"
    (tmp_path / "disk").mkdir()
    (tmp_path / "hf").symlink_to(tmp_path / "disk" / "base", target_is_directory=True)
    return tmp_path / "disk", tmp_path / "hf", tmp_path / "disk" / "base"


@pytest.mark.parametrize("nesting", NESTINGS)
def test_pushes_delete_only_the_version_directories_they_wrote(nesting, tmp_path, monkeypatch):
    disk_dir, hf_checkpoint, real_checkpoint = _layout(tmp_path, nesting)
    _write_checkpoint(real_checkpoint, "the checkpoint the engines started on")
    (real_checkpoint / "tokenizer.json").write_text("{}")
    assert _push_versions(monkeypatch, disk_dir, hf_checkpoint, 3) == ["1", "2", "3"]
    assert sorted(p.name for p in real_checkpoint.iterdir() if not p.name.startswith("weight_v")
                  and p.name != "updates") == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (real_checkpoint / "config.json").read_text() == "the checkpoint the engines started on"
    # the last acknowledged version is the roll-back point; the two before it were this job's, and go
    assert sorted(p.name for p in disk_dir.iterdir() if p.name.startswith("weight_v")) == ["weight_v000003"]


def test_keep_files_deletes_nothing(tmp_path, monkeypatch):
    disk_dir, hf = tmp_path / "disk", _write_checkpoint(tmp_path / "disk" / "hf", "start")
    _push_versions(monkeypatch, disk_dir, hf, 3, update_weight_disk_keep_files=True)
    assert sorted(p.name for p in disk_dir.iterdir()) == ["hf", "weight_v000001", "weight_v000002", "weight_v000003"]


def test_a_version_directory_replaced_after_its_push_is_not_deleted(tmp_path, monkeypatch):
    """Between two pushes weight_v000001 is swapped for another directory (no marker) and weight_v000002 for a
    link to someone's files: neither is what this job wrote, and neither is deleted."""
    disk_dir, hf = tmp_path / "disk", _write_checkpoint(tmp_path / "hf", "start")
    precious = _write_checkpoint(tmp_path / "precious", "not ours")

    def swap(version):
        if version == 1:
            shutil.rmtree(disk_dir / "weight_v000001")
            _write_checkpoint(disk_dir / "weight_v000001", "someone else's")
        if version == 2:
            shutil.rmtree(disk_dir / "weight_v000002")
            (disk_dir / "weight_v000002").symlink_to(precious, target_is_directory=True)

    _push_versions(monkeypatch, disk_dir, hf, 3, between=swap)
    assert (disk_dir / "weight_v000001" / "config.json").read_text() == "someone else's"
    assert (precious / "config.json").read_text() == "not ours" and (disk_dir / "weight_v000002").is_symlink()
    assert (hf / "config.json").read_text() == "start"


@pytest.mark.parametrize("flag", ["load", "ref_load", "save"])
def test_a_version_directory_holding_another_flags_path_is_not_deleted(flag, tmp_path, monkeypatch):
    disk_dir, hf = tmp_path / "disk", _write_checkpoint(tmp_path / "hf", "start")
    held = disk_dir / "weight_v000001" / "mcore"

    def plant(version):
        if version == 1:
            _write_checkpoint(held, "megatron")

    _push_versions(monkeypatch, disk_dir, hf, 2, between=plant, **{flag: str(held)})
    assert (held / "config.json").read_text() == "megatron"


def test_with_no_engines_only_the_pushed_version_goes(tmp_path, monkeypatch):
    """slime deletes the version at once when no engine is updatable; the checkpoint beside it stays."""
    fake_ray = types.ModuleType("ray")
    fake_ray.get = get
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    disk_dir = tmp_path / "disk"
    hf = _write_checkpoint(disk_dir / "hf", "start")
    args = Namespace(update_weight_local_checkpoint_dir=None, offload_rollout=False,
                     update_weight_disk_keep_files=False, update_weight_disk_dir=str(disk_dir), hf_checkpoint=str(hf))
    group = types.SimpleNamespace(args=args, _rollout_manager=types.SimpleNamespace(
        get_updatable_engines_and_lock=Call(lambda: ([], None, 0, [], []))))
    reload = _reload(lambda *a: pytest.fail("not with a disk dir"))
    reload(group, _write_checkpoint(disk_dir / "weight_v000001", "v1"), "1")
    reload(group, hf, "2")  # a version path that is the checkpoint is never deleted
    assert sorted(p.name for p in disk_dir.iterdir()) == ["hf"] and (hf / "config.json").read_text() == "start"

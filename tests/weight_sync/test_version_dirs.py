"""weight_sync.version_dirs: only version directories this job marked are deleted, checked again at deletion."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from slime_ascend.weight_sync.version_dirs import MARKER, VersionDirs


def _version(disk: Path, n: int) -> Path:
    d = disk / f"weight_v{n:06d}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_text(f"v{n}")
    return d


def test_a_claimed_version_directory_is_deleted(tmp_path):
    dirs = VersionDirs(str(tmp_path), [str(tmp_path.parent / "hf")])
    d = _version(tmp_path, 1)
    assert dirs.claim(d, "1")
    marker = json.loads((d / MARKER).read_text())
    assert marker["version"] == "1" and len(marker["job"]) == 32
    assert not dirs.delete(d, "2")  # another version's marker text: kept
    assert dirs.delete(d, "1") and not d.exists()
    assert not dirs.delete(d, "1")  # once


def test_an_unclaimed_directory_is_never_deleted(tmp_path):
    dirs = VersionDirs(str(tmp_path), [])
    d = _version(tmp_path, 1)
    assert not dirs.delete(d, "1") and (d / "model.safetensors").exists()


@pytest.mark.parametrize("case", ["is_the_checkpoint", "contains_load", "symlink", "not_directly_inside",
                                  "marker_already_there", "a_file"])
def test_claims_refused(case, tmp_path, caplog):
    disk = tmp_path / "disk"
    d = _version(disk, 1)
    protected = []
    if case == "is_the_checkpoint":
        protected = [str(d)]
    elif case == "contains_load":
        protected = [str(d / "iter_0000001")]  # need not exist yet
    elif case == "symlink":
        target = _version(tmp_path / "elsewhere", 1)
        d = disk / "weight_v000002"
        d.symlink_to(target, target_is_directory=True)
    elif case == "not_directly_inside":
        d = _version(disk / "sub", 3)
    elif case == "marker_already_there":
        (d / MARKER).write_text("{}")
    else:
        d = disk / "weight_v000004"
        d.write_text("x")
    dirs = VersionDirs(str(disk), protected)
    assert not dirs.claim(d, "1")
    assert "is kept" in caplog.text and str(d) in caplog.text
    assert not dirs.delete(d, "1") and os.path.lexists(d)


def test_the_checkpoint_reached_through_a_link_is_protected(tmp_path):
    """--hf-checkpoint is a link whose target sits in the disk dir under a version's name."""
    disk = tmp_path / "disk"
    d = _version(disk, 1)
    (tmp_path / "hf").symlink_to(d, target_is_directory=True)
    dirs = VersionDirs(str(disk), [str(tmp_path / "hf")])
    assert not dirs.claim(d, "1") and not dirs.delete(d, "1") and d.exists()


@pytest.mark.parametrize("change", ["marker_removed", "marker_rewritten", "marker_is_a_fifo", "swapped_for_a_link"])
def test_deletion_checks_again(change, tmp_path):
    disk = tmp_path / "disk"
    d = _version(disk, 1)
    dirs = VersionDirs(str(disk), [])
    assert dirs.claim(d, "1")
    other = _version(tmp_path / "other", 1)
    if change == "marker_removed":
        (d / MARKER).unlink()
    elif change == "marker_rewritten":
        (d / MARKER).write_text(json.dumps({"version": "1", "job": "0" * 32}))
    elif change == "marker_is_a_fifo":
        (d / MARKER).unlink()
        os.mkfifo(d / MARKER)
    else:
        os.rename(d, tmp_path / "moved")
        d.symlink_to(other, target_is_directory=True)
    result: list[bool] = []
    worker = threading.Thread(target=lambda: result.append(dirs.delete(d, "1")), daemon=True)
    worker.start()
    worker.join(10)
    assert result == [False], "deletion blocked or went ahead"
    assert os.path.lexists(d) and (other / "model.safetensors").exists()


def test_the_disk_dir_reached_through_a_link(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "disk").symlink_to(tmp_path / "real", target_is_directory=True)
    d = _version(tmp_path / "disk", 1)
    dirs = VersionDirs(str(tmp_path / "disk"), [str(tmp_path / "real" / "hf")])
    assert dirs.claim(d, "1") and dirs.delete(d, "1") and not (tmp_path / "real" / "weight_v000001").exists()

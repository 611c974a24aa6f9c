"""`quant._outdir`: which OUT_DIRs are refused, and the staged write that swaps in only on success."""

from __future__ import annotations

import os
import stat

import pytest

from slime_ascend.quant import _outdir
from slime_ascend.quant._outdir import check_out_dir, looks_like_checkpoint, staged_dir


def _ckpt(d, marker="old"):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_text(marker)
    return d


def test_check_out_dir_rules(tmp_path):
    src = _ckpt(tmp_path / "a" / "hf")
    (tmp_path / "link").symlink_to(src, target_is_directory=True)
    for dst, needle in [(src, "must differ"), (tmp_path / "link", "must differ"), (src / "q", "is inside"),
                        (tmp_path / "a", "contains"), (tmp_path, "contains")]:
        with pytest.raises(ValueError, match=needle):
            check_out_dir(str(src), str(dst), True)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        check_out_dir(str(src), str(f), True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.txt").write_text("x")
    with pytest.raises(ValueError, match="pass --force"):
        check_out_dir(str(src), str(other), False)
    with pytest.raises(ValueError, match="holds no checkpoint"):
        check_out_dir(str(src), str(other), True)
    prev = _ckpt(tmp_path / "prev")
    assert check_out_dir(str(src), str(prev), True) == str(prev)
    assert check_out_dir(str(src), str(tmp_path / "new" / "q"), False) == str(tmp_path / "new" / "q")
    # a sibling whose name merely starts with the source's is not "inside" it
    assert check_out_dir(str(src), str(tmp_path / "a" / "hf2"), False) == str(tmp_path / "a" / "hf2")
    assert looks_like_checkpoint(str(prev)) and not looks_like_checkpoint(str(other))


def test_staged_dir_is_private_then_replaces_previous(tmp_path):
    final = _ckpt(tmp_path / "q", "old")
    with staged_dir(str(final)) as work:
        assert os.path.dirname(work) == str(tmp_path) and os.path.basename(work).startswith(".q.tmp-")
        assert stat.S_IMODE(os.stat(work).st_mode) == 0o700
        assert (final / "model.safetensors").read_text() == "old"  # untouched while writing
        _ckpt(tmp_path / os.path.basename(work), "new")
    assert (final / "model.safetensors").read_text() == "new"
    assert os.listdir(tmp_path) == ["q"]
    mask = os.umask(0o022)
    os.umask(mask)
    assert stat.S_IMODE(os.stat(final).st_mode) == 0o777 & ~mask  # what mkdir would have given, not 0700


@pytest.mark.parametrize("exc", [ValueError("bad"), KeyboardInterrupt()])
def test_staged_dir_failure_removes_only_the_temporary(tmp_path, exc):
    final = _ckpt(tmp_path / "q", "old")
    with pytest.raises(type(exc)):
        with staged_dir(str(final)) as work:
            _ckpt(tmp_path / os.path.basename(work), "half")
            raise exc
    assert (final / "model.safetensors").read_text() == "old"
    assert os.listdir(tmp_path) == ["q"]


def test_staged_dir_puts_the_previous_output_back_when_the_swap_fails(tmp_path, monkeypatch):
    final = _ckpt(tmp_path / "q", "old")
    real_rename, calls = os.rename, []

    def rename(a, b):
        calls.append((a, b))
        if len(calls) == 2:  # old -> aside worked; new -> final fails
            raise OSError(18, "Invalid cross-device link")
        return real_rename(a, b)

    monkeypatch.setattr(_outdir.os, "rename", rename)
    with pytest.raises(OSError):
        with staged_dir(str(final)) as work:
            _ckpt(tmp_path / os.path.basename(work), "new")
    assert len(calls) == 3 and calls[2][1] == str(final)
    assert (final / "model.safetensors").read_text() == "old"
    assert os.listdir(tmp_path) == ["q"]


def test_staged_dir_creates_missing_parents_and_new_output(tmp_path):
    final = tmp_path / "x" / "y" / "q"
    with staged_dir(str(final)) as work:
        _ckpt(tmp_path / "x" / "y" / os.path.basename(work), "new")
    assert (final / "model.safetensors").read_text() == "new"
    assert os.listdir(final.parent) == ["q"]

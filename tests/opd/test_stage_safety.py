"""Teacher names become directories under ascend_opd_stage_dir, and staging replaces directories:
a name can never point outside the stage directory, and staging never deletes what it did not create."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime_ascend.opd.plugin import SETTINGS
from slime_ascend.opd.engine_loader import STAGE_MARKER, SGLangEngineLoader
from slime_ascend.opd.pool import TeacherLoadError, TeacherPool
from slime_ascend.opd.teachers import TeacherConfigError, TeacherSpec, parse_teachers
from slime_ascend.plugins.settings import SettingsError, coerce

BAD_NAMES = ["../victim", "/abs/victim", ".", "..", "a/b", "-rf", "x" * 65, "math\n"]
TEACHERS = next(s for s in SETTINGS if s.key == "ascend_opd_teachers")


def _ckpt(root: Path, name: str = "src", content: bytes = b"w" * 10) -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.safetensors").write_bytes(content)
    return d


def _victim(root: Path) -> Path:
    v = root / "victim"
    v.mkdir()
    (v / "precious.txt").write_text("keep me")
    return v


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_teacher_names_are_refused_at_config_time(name):
    raw = [{"name": name, "checkpoint_dir": "/ckpt", "domains": ["d"]}]
    with pytest.raises(TeacherConfigError, match=r"field 'name'.*Fix: use 1-64 characters"):
        parse_teachers(raw)
    with pytest.raises(SettingsError, match="ascend_opd_teachers"):  # the setting's check, run at process start
        coerce(TEACHERS, raw)


def test_good_names_pass():
    names = ["math", "Code-2", "glm4.5_air", "x" * 64]
    specs = parse_teachers([{"name": n, "checkpoint_dir": "/c", "domains": [n]} for n in names])
    assert [s.name for s in specs] == names


def test_a_spec_built_in_code_is_checked_too():
    with pytest.raises(TeacherConfigError, match="'../victim'"):
        parse_teachers([TeacherSpec(name="../victim", checkpoint_dir=Path("/c"), domains=("d",))])


@pytest.mark.parametrize("name", ["../victim", "ABS", "."])
def test_staging_never_touches_a_path_outside_the_stage_dir(tmp_path, name):
    victim = _victim(tmp_path)
    name = str(victim) if name == "ABS" else name
    stage = tmp_path / "stage"
    loader = SGLangEngineLoader("http://engine", stage_dir=stage)
    spec = TeacherSpec(name=name, checkpoint_dir=_ckpt(tmp_path), domains=("d",))  # bypasses parse_teachers
    with pytest.raises(ValueError, match="not usable as a directory"):
        loader.stage(spec)
    assert (victim / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "stage", "victim"]
    assert list(stage.iterdir()) == []


def test_a_link_in_the_stage_dir_pointing_outside_is_refused(tmp_path):
    victim = _victim(tmp_path)
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "math").symlink_to(victim, target_is_directory=True)
    loader = SGLangEngineLoader("http://engine", stage_dir=stage)
    with pytest.raises(ValueError, match="outside the stage directory"):
        loader.stage(TeacherSpec(name="math", checkpoint_dir=_ckpt(tmp_path), domains=("d",)))
    assert (victim / "precious.txt").read_text() == "keep me" and (stage / "math").is_symlink()


@pytest.mark.parametrize("entry", ["math", ".math.staging"])
def test_a_foreign_directory_in_the_stage_dir_is_not_deleted(tmp_path, entry):
    stage = tmp_path / "stage"
    foreign = stage / entry
    foreign.mkdir(parents=True)
    (foreign / "someone_elses.bin").write_bytes(b"x")
    specs = [TeacherSpec(name="math", checkpoint_dir=_ckpt(tmp_path), domains=("math",))]
    post = lambda url, payload, timeout: {"success": True}  # noqa: E731
    with TeacherPool(specs, SGLangEngineLoader("http://engine", stage_dir=stage, post=post), validate=False) as pool:
        with pytest.raises(TeacherLoadError, match=r"teacher 'math'.*not staged by slime-ascend.*neither reused nor "):
            pool.activate("math")
    assert (foreign / "someone_elses.bin").read_bytes() == b"x"


def test_a_foreign_directory_with_the_same_files_is_not_reused(tmp_path):
    src = _ckpt(tmp_path)
    stage = tmp_path / "stage"
    _ckpt(stage, "math")  # same names and sizes as src, but not staged by the pool
    with pytest.raises(FileExistsError, match="not staged by slime-ascend"):
        SGLangEngineLoader("http://engine", stage_dir=stage).stage(TeacherSpec("math", src, ("d",)))


def test_own_stage_is_marked_reused_and_replaced(tmp_path):
    stage = tmp_path / "stage"
    loader = SGLangEngineLoader("http://engine", stage_dir=stage)
    src = _ckpt(tmp_path)
    spec = TeacherSpec(name="math", checkpoint_dir=src, domains=("d",))
    first = loader.stage(spec).payload
    assert first == stage / "math" and (first / STAGE_MARKER).is_file()
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert loader.stage(spec).payload == first  # same files: reused
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    (src / "model.safetensors").write_bytes(b"v" * 20)  # new checkpoint: our own copy is replaced
    assert (loader.stage(spec).payload / "model.safetensors").read_bytes() == b"v" * 20
    assert sorted(p.name for p in stage.iterdir()) == ["math"]  # no staging leftovers

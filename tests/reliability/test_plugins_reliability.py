"""Replayed bad inputs for the plugin machinery (issue 14 item 2, issue 15 items 2, 7, 8): each is
fed through the surface a user touches (the CLI, the .pth bootstrap, slime's parse_args) and must
end in one clear line naming the field and the fix, never a traceback, and delete nothing it did
not create. Fresh interpreters, tmp_path only, a stand-in slime of three functions."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import run_python

from slime_ascend.opd.engine_loader import SGLangEngineLoader
from slime_ascend.opd.pool import TeacherLoadError, TeacherPool
from slime_ascend.opd.teachers import TeacherSpec


def cli(*argv: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "SLIME_ASCEND_PLUGINS"} | (env or {})
    return subprocess.run([sys.executable, "-m", "slime_ascend.cli", *argv], capture_output=True, text=True,
                          cwd=cwd, env=full, timeout=120)


def one_line_error(proc: subprocess.CompletedProcess, prefix: str = "error:") -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if prefix in line]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def pythonpath(*extra: Path) -> str:
    return os.pathsep.join([*map(str, extra), *filter(None, [os.environ.get("PYTHONPATH")])])


# ---- issue 14 item 2: `config --flags` ------------------------------------------------------------
def test_flags_line_is_the_only_stdout_and_round_trips(tmp_path):
    proc = cli("config", "npu", "sao", "--flags", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n") and proc.stdout.count("\n") == 1
    words = shlex.split(proc.stdout)
    assert words == ["--advantage-estimator", "ppo", "--n-samples-per-prompt", "1",
                     "--megatron-config-path", "sao_megatron.yaml"]
    assert shlex.join(words) == proc.stdout.strip() and list(tmp_path.iterdir()) == []
    assert cli("config", "npu", "--flags").stdout == ""


# ---- issue 15 item 2: OPD teacher names and the stage directory ------------------------------------
@pytest.mark.parametrize("name", ["../victim", "/abs/victim", "."])
def test_config_refuses_a_teacher_name_that_is_a_path(tmp_path, name):
    teachers = yaml.safe_dump([{"name": name, "checkpoint_dir": "/c", "domains": ["d"]}], default_flow_style=True)
    out = tmp_path / "ascend.yaml"
    line = one_line_error(cli("config", "opd", "--set", f"ascend_opd_teachers={teachers.strip()}", "-o", str(out)))
    assert "ascend_opd_teachers" in line and "field 'name'" in line and "Fix:" in line
    assert not out.exists()


@pytest.mark.parametrize("name", ["../victim", "ABS", "."])
def test_staging_a_path_like_name_deletes_nothing(tmp_path, name):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"w")
    before = tree(tmp_path)
    spec = TeacherSpec(name=str(victim) if name == "ABS" else name, checkpoint_dir=src, domains=("d",))
    with pytest.raises(ValueError, match="not usable as a directory under the stage directory"):
        SGLangEngineLoader("http://engine", stage_dir=tmp_path / "stage").stage(spec)
    assert {k: v for k, v in tree(tmp_path).items() if not k.startswith("stage")} == before


def test_staging_leaves_a_foreign_directory_in_the_stage_dir(tmp_path):
    stage = tmp_path / "stage"
    (stage / "math").mkdir(parents=True)
    (stage / "math" / "someone_elses.bin").write_bytes(b"x")
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"w")
    before = tree(stage)
    post = lambda url, payload, timeout: {"success": True}  # noqa: E731
    spec = TeacherSpec(name="math", checkpoint_dir=src, domains=("math",))
    with TeacherPool([spec], SGLangEngineLoader("http://e", stage_dir=stage, post=post), validate=False) as pool:
        with pytest.raises(TeacherLoadError, match="not staged by slime-ascend.*Fix:"):
            pool.activate("math")
    assert tree(stage) == before


# ---- issue 15 item 7: plugin code raising SystemExit / KeyboardInterrupt at process start ----------
@pytest.fixture
def boom(tmp_path):
    dist = tmp_path / "boomplug-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: boomplug\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[slime_ascend.plugins]\nboom = boomplug:PLUGIN\n")
    (tmp_path / "boomplug.py").write_text(textwrap.dedent("""
        import os
        from slime_ascend.plugins.base import Plugin
        def die():
            raise SystemExit(3) if os.environ["BOOM_KIND"] == "exit" else KeyboardInterrupt()
        PLUGIN = Plugin(name="boom", description="x", process_start=("boomplug.die",))
    """))
    return tmp_path


@pytest.mark.parametrize("kind", ["exit", "interrupt"])
def test_every_interpreter_of_the_venv_survives_a_plugin_that_exits(boom, kind):
    env = {"SLIME_ASCEND_PLUGINS": "boom", "PYTHONPATH": pythonpath(boom), "BOOM_KIND": kind}
    alive = run_python("print('alive')", env=env)
    assert alive.returncode == 0 and alive.stdout == "alive\n", alive.stderr
    assert alive.stderr.count("slime-ascend: activation of SLIME_ASCEND_PLUGINS='boom' failed") == 1
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert pip.returncode == 0 and pip.stdout.startswith("pip "), pip.stderr


# ---- issue 15 item 8: settings and conflicts refused at process start / config time ----------------
FAKE_ARGUMENTS = """
import argparse, yaml
def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--custom-config-path")
    args, _ = p.parse_known_args()
    for k, v in (yaml.safe_load(open(args.custom_config_path)) or {}).items():
        setattr(args, k, v)
    return args
"""


@pytest.fixture
def driver(tmp_path):
    site = tmp_path / "site"
    (site / "slime" / "utils").mkdir(parents=True)
    (site / "slime" / "__init__.py").write_text("")
    (site / "slime" / "utils" / "__init__.py").write_text("")
    (site / "slime" / "utils" / "arguments.py").write_text(FAKE_ARGUMENTS)

    def run(plugins: str, data: dict) -> subprocess.CompletedProcess:
        path = tmp_path / "ascend.yaml"
        path.write_text(yaml.safe_dump(data))
        return run_python(
            f"import sys; sys.argv = ['train.py', '--custom-config-path', {str(path)!r}]\n"
            "from slime.utils.arguments import parse_args\nparse_args()\nprint('first rollout')\n",
            env={"SLIME_ASCEND_PLUGINS": plugins, "PYTHONPATH": pythonpath(site)},
        )

    return run


def _generated(*argv: str) -> dict:
    proc = cli("config", *argv, "-o", "-")
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def test_config_refuses_dis_with_icepop(tmp_path):
    line = one_line_error(cli("config", "dis", "icepop", "-o", str(tmp_path / "a.yaml")))
    assert "'dis' cannot be enabled with 'icepop'" in line and "ascend_dis_weight" in line
    assert not (tmp_path / "a.yaml").exists()


@pytest.mark.parametrize("case,plugins,edit,expect", [
    ("dis+icepop edited back to ratio", "dis,icepop", {"ascend_dis_weight": "ratio"}, "icepop both multiply"),
    ("bad value", "dis", {"ascend_dis_weight": "sometimes"}, "ascend_dis_weight='sometimes'"),
    ("misspelled key", "sao", {"ascend_sao_critic_iter": 4}, "did you mean 'ascend_sao_critic_iters'"),
])
def test_driver_refuses_at_parse_args_before_any_rollout(driver, case, plugins, edit, expect):
    base = _generated(*plugins.split(","), *(["--set", "ascend_dis_weight=mask"] if "icepop" in plugins else []))
    line = one_line_error(driver(plugins, {**base, **edit}), prefix="slime-ascend: error:")
    assert expect in line, case


def test_driver_starts_with_a_good_config(driver):
    proc = driver("dis", _generated("dis"))
    assert proc.returncode == 0 and proc.stdout == "first rollout\n", proc.stderr

"""``slime-ascend dryrun -- <launch>``: an Ascend launch checked on this host, one line per problem, before NPU time.

The slime cases run the real command: ``slime-ascend dryrun`` in a subprocess, which runs slime's own
``parse_args`` with the job's plugins (``npu,sglang-npu``) on a tiny model's command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from slime_ascend import dryrun
from slime_ascend.command import UserError

PLUGINS = "npu,sglang-npu"
RELEASE = ["--release-train", "--update-weight-transport", "disk", "--update-weight-disk-dir", "{tmp}/sync",
           "--save", "{tmp}/ckpt"]


# -- the launch command taken apart ------------------------------------------------------------------------------
def test_python_launch_with_environment_words():
    launch = dryrun.split_launch(["A=1", "B=x=y", "python3", "-u", "/slime/train_async.py", "--colocate"])
    assert launch == dryrun.Launch({"A": "1", "B": "x=y"}, "/slime/train_async.py", ["--colocate"])
    assert dryrun.split_launch(["--colocate"]) == dryrun.Launch({}, "train.py", ["--colocate"])
    assert dryrun.split_launch(["env", "A=1", "train.py"]).env == {"A": "1"}


def test_ray_job_submit_carries_its_runtime_env():
    env_json = json.dumps({"env_vars": {"SLIME_ASCEND_PLUGINS": PLUGINS, "PYTORCH_NPU_ALLOC_CONF": "x"}})
    for words in (["--runtime-env-json", env_json], [f"--runtime-env-json={env_json}"]):
        launch = dryrun.split_launch(["ray", "job", "submit", "--address=http://127.0.0.1:8265", *words, "--",
                                      "python3", "$SLIME_DIR/train.py", "--colocate"])
        assert launch.env == {"SLIME_ASCEND_PLUGINS": PLUGINS, "PYTORCH_NPU_ALLOC_CONF": "x"}
        assert launch.script == "$SLIME_DIR/train.py" and launch.argv == ["--colocate"]


@pytest.mark.parametrize("words, message", [
    (["ray", "job", "submit", "python3", "train.py"], "without `--`"),
    (["ray", "job", "submit", "--runtime-env-json", "{", "--", "train.py"], "--runtime-env-json is not JSON"),
    (["python", "-m", "slime"], "python -m slime"),
    (["bash", "run.sh"], "no slime script in the command"),
])
def test_an_unreadable_launch_is_one_line(words, message):
    with pytest.raises(UserError, match="Fix:") as info:
        dryrun.split_launch(words)
    assert message in str(info.value) and "\n" not in str(info.value)


# -- checks that need no slime ---------------------------------------------------------------------------------
def _cli(*argv, env=None, cwd=None):
    full = {**os.environ, **(env or {})}
    for name in ("SLIME_ASCEND_PLUGINS", "PYTORCH_ALLOC_CONF", "PYTORCH_NPU_ALLOC_CONF", "RAY_OVERRIDE_RESOURCES"):
        if name not in (env or {}):
            full.pop(name, None)
    return subprocess.run([sys.executable, "-m", "slime_ascend.cli", "dryrun", *argv], capture_output=True,
                          text=True, env=full, cwd=cwd, timeout=600)


@pytest.mark.parametrize("argv, line", [
    ((), "plugins: SLIME_ASCEND_PLUGINS is not set for the job"),
    (("--plugins", "npu,no-such-plugin"), "plugins: "),
])
def test_plugins_missing_or_unknown(argv, line):
    proc = _cli(*argv, "--", "python", "train.py", "--colocate")
    assert proc.returncode == 1 and proc.stdout.startswith(line) and proc.stdout.count("\n") == 1, proc.stdout
    assert "Fix:" in proc.stdout


def test_no_launch_command_is_a_usage_error():
    proc = _cli("--plugins", PLUGINS)
    assert proc.returncode == 2 and "no launch command" in proc.stderr and proc.stderr.count("\n") == 1


def test_placement_against_the_declared_cluster():
    found = {"npus_needed": 16, "actor_num_nodes": 2, "actor_num_gpus_per_node": 8, "num_gpus_per_node": 8,
             "rollout_num_gpus_per_engine": 8, "colocate": True}
    assert dryrun.placement_problems(found, None, None, {}) == []
    short = dryrun.placement_problems(found, 1, None, {})
    assert len(short) == 1 and "asks Ray for 16 NPUs" in short[0] and "has 8 (1 node(s) (--nodes) of 8 NPUs)" in short[0]
    assert "has 12 (RAY_OVERRIDE_RESOURCES' NPU)" in dryrun.placement_problems(
        found, None, None, {"RAY_OVERRIDE_RESOURCES": '{"NPU": 12}'})[0]
    wide = dryrun.placement_problems({**found, "rollout_num_gpus_per_engine": 12}, None, None, {})
    assert len(wide) == 1 and "--rollout-num-gpus-per-engine 12 spans nodes of 8 NPUs unevenly" in wide[0]
    per_node = dryrun.placement_problems(found, None, 4, {})
    assert any("--actor-num-gpus-per-node 8 is more than the 4 NPUs of a node" in p for p in per_node)


def test_ray_would_undercount_npus_without_pyacl(tmp_path, monkeypatch):
    from slime_ascend.accelerator import launch

    for i in range(16):
        (tmp_path / f"davinci{i}").touch()
    (tmp_path / "davinci_manager").touch()
    problem = launch.ray_npu_detection_problem(str(tmp_path))
    assert problem and "10 of the 16 found" in problem and "set_env.sh" in problem
    monkeypatch.setattr(launch.importlib.util, "find_spec", lambda name: object())  # pyACL importable
    assert launch.ray_npu_detection_problem(str(tmp_path)) is None


# -- slime's own parse_args ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A tiny model's config.json, the job's YAML (``slime-ascend config npu sglang-npu``) and its flags."""
    from conftest import need
    from transformers import Qwen3Config

    from slime_ascend import config
    from slime_parse_args import TINY_FLAGS

    need("slime.utils.arguments")
    tmp = tmp_path_factory.mktemp("dryrun")
    Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                tie_word_embeddings=False).save_pretrained(tmp / "hf")
    (tmp / "ascend.yaml").write_text(config.build(PLUGINS.split(",")).yaml_text)
    flags = ["--hf-checkpoint", "/cluster/models/tiny", *TINY_FLAGS, "--custom-config-path", str(tmp / "ascend.yaml")]
    assert "--colocate" in flags
    return tmp, flags


def _dryrun(job, *extra, env=None):
    tmp, flags = job
    extra = [w.format(tmp=tmp) for w in extra]
    return _cli("--hf-config", str(tmp / "hf"), "--", "SLIME_ASCEND_PLUGINS=" + PLUGINS,
                "PYTORCH_NPU_ALLOC_CONF=expandable_segments:False", "python", "train.py", *flags, *extra, env=env)


@pytest.mark.slime
def test_a_clean_command_passes(job):
    proc = _dryrun(job, *RELEASE)
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-3000:])
    assert proc.stdout.startswith(f"ok: slime's parse_args and the plugins' checks ({PLUGINS}) accept the command")
    assert "asks Ray for 1 NPUs" in proc.stdout


@pytest.mark.slime
def test_colocate_without_release_train_is_one_line(job):
    proc = _dryrun(job)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1 and len(lines) == 1, (proc.stdout, proc.stderr[-3000:])
    assert lines[0].startswith("npu: --colocate without --release-train") and "Fix: add --release-train" in lines[0]


@pytest.mark.slime
def test_both_allocator_variables_are_one_line(job):
    """This shell's PYTORCH_ALLOC_CONF beside the job's PYTORCH_NPU_ALLOC_CONF (the examples unset it)."""
    proc = _dryrun(job, *RELEASE, env={"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1 and len(lines) == 1, (proc.stdout, proc.stderr[-3000:])
    assert lines[0].startswith("npu: both allocator variables are set for the train actors")
    assert "PYTORCH_ALLOC_CONF='expandable_segments:True'" in lines[0] and "Fix: unset PYTORCH_ALLOC_CONF" in lines[0]


@pytest.mark.slime
def test_a_bad_flag_is_slimes_own_line(job):
    proc = _dryrun(job, *RELEASE, "--no-such-flag")
    assert proc.returncode == 1 and proc.stdout.count("\n") == 1, (proc.stdout, proc.stderr[-3000:])
    assert proc.stdout.startswith("slime: ") and "--no-such-flag" in proc.stdout


def test_a_checkpoint_not_on_this_host_needs_hf_config(tmp_path):
    yaml_path = tmp_path / "ascend.yaml"
    yaml_path.write_text("ascend_plugins: [npu]\n")
    proc = _cli("--plugins", "npu", "--", "python", "train.py", "--hf-checkpoint", "/cluster/models/x",
                "--custom-config-path", str(yaml_path))
    assert proc.returncode == 1 and proc.stdout.count("\n") == 1
    assert proc.stdout.startswith("--hf-checkpoint /cluster/models/x: no config.json on this host")
    assert "Fix: rerun the dry run with --hf-config DIR" in proc.stdout

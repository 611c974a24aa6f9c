import argparse
import subprocess
import sys

import pytest
import yaml

from slime_ascend import config
from slime_ascend.plugins import registry
from slime_ascend.plugins.base import CommandLineFlag, Contribution, Plugin
from slime_ascend.plugins.settings import Setting, SettingsError


@pytest.fixture
def demo_plugins(fresh_runtime):
    registry.register(Plugin(
        name="c-one", description="first",
        settings=(Setting("ascend_one_eps", float, 0.2, "clip epsilon"),
                  Setting("ascend_one_mode", str, "a", "mode", choices=("a", "b"))),
        contributions=(Contribution("loss", "slime_ascend.hooks.loss_function"),
                       Contribution("rollout_sample_hook", "slime_ascend.hooks.rollout_sample_hook")),
        slime_args=(("use_tis", True),),
        command_line=(CommandLineFlag("--advantage-estimator ppo", "a critic is needed"),),
    ))


def test_yaml_sets_hooks_settings_and_slime_keys(demo_plugins):
    gen = config.build(["c-one"])
    data = yaml.safe_load(gen.yaml_text)
    assert data["ascend_plugins"] == ["c-one"]
    assert data["custom_loss_function_path"] == "slime_ascend.hooks.loss_function"
    assert data["rollout_sample_hook_path"] == ["slime_ascend.hooks.rollout_sample_hook"]
    assert data["loss_type"] == "custom_loss" and data["use_tis"] is True
    assert data["ascend_one_eps"] == 0.2 and data["ascend_one_mode"] == "a"
    assert "custom_advantage_function_path" not in data  # only slots in use
    assert "# clip epsilon (float)" in gen.yaml_text
    assert gen.env_value == "c-one"
    assert gen.command_line == [("--advantage-estimator ppo", "c-one", "a critic is needed")]
    hint = gen.hint("ascend.yaml")
    assert "export SLIME_ASCEND_PLUGINS=c-one" in hint and "--custom-config-path ascend.yaml" in hint


@pytest.mark.parametrize("name", sorted(registry.available()))
def test_every_installed_plugin_config_loads(name):
    from slime_ascend.plugins.base import resolve

    gen = config.build([name])
    data = yaml.safe_load(gen.yaml_text)
    assert name in data["ascend_plugins"]
    for plugin in data["ascend_plugins"]:
        assert plugin in registry.available()
    for key, value in data.items():
        if key.endswith("_path") and value:
            for path in value if isinstance(value, list) else [value]:
                assert callable(resolve(path))


def test_cli_writes_file_and_refuses_overwrite(tmp_path):
    out = tmp_path / "a.yaml"
    cmd = [sys.executable, "-m", "slime_ascend.cli", "config", "npu", "-o", str(out)]
    first = subprocess.run(cmd, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert "export SLIME_ASCEND_PLUGINS=npu" in first.stdout
    assert yaml.safe_load(out.read_text())["ascend_plugins"] == ["npu"]
    second = subprocess.run(cmd, capture_output=True, text=True)
    assert second.returncode == 2 and "--force" in second.stderr


def test_cli_unknown_plugin_is_a_clean_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", "nope", "-o", str(tmp_path / "x")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown plugin 'nope'" in proc.stderr and "Traceback" not in proc.stderr


# ---- config --flags ------------------------------------------------------------------------------
def _cli(*argv, cwd=None):
    return subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", *argv], capture_output=True, text=True,
                          cwd=cwd)


def _declared_words(names):
    """The pasteable words, read straight from the plugins' declarations (not through config.py)."""
    import shlex

    words = []
    for plugin in registry.resolve_selection(names).plugins:
        for flag in plugin.command_line:
            parts = shlex.split(flag.flag)
            if parts[0].startswith("--") and not any(w.isupper() or w == "..." for w in parts[1:]):
                words += parts
    return words


def test_flags_prints_one_line_of_the_declared_flags_and_writes_nothing(tmp_path):
    import shlex

    proc = _cli("npu", "sao", "--flags", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1
    words = shlex.split(proc.stdout)
    assert words == _declared_words(["npu", "sao"])
    assert words[:2] == ["--advantage-estimator", "ppo"] and "--n-samples-per-prompt" in words
    assert "train_async.py" not in proc.stdout  # advice goes to stderr, not onto the command line
    assert "train_async.py" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no YAML written


def test_flags_empty_output_when_no_plugin_needs_any():
    proc = _cli("npu", "--flags")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""


def test_flags_leave_values_only_the_user_knows_to_the_user():
    proc = _cli("vllm-ascend", "--flags")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["--update-weight-transport", "disk"]
    assert "--update-weight-disk-dir DIR" in proc.stderr and "HOST:PORT" in proc.stderr


def test_flags_and_output_are_alternatives(tmp_path):
    both = _cli("npu", "--flags", "-o", str(tmp_path / "x.yaml"))
    assert both.returncode == 2 and "not allowed with" in both.stderr and not (tmp_path / "x.yaml").exists()
    neither = _cli("npu")
    assert neither.returncode == 2 and "-o/--output --flags is required" in neither.stderr


def test_flags_line_round_trips_through_shlex_and_bash_eval(fresh_runtime, capsys):
    import shlex
    import shutil

    from slime_ascend import cli

    registry.register(Plugin(name="c-quote", description="odd values", command_line=(
        CommandLineFlag("--run-name 'two words' --pattern 'a*b;$(x)'", "values that need quoting"),
        CommandLineFlag("--switch", "a bare option"),
    )))
    assert cli.main(["config", "c-quote", "--flags"]) == 0
    out = capsys.readouterr().out
    expected = ["--run-name", "two words", "--pattern", "a*b;$(x)", "--switch"]
    assert shlex.split(out) == expected
    if shutil.which("bash"):
        done = subprocess.run(["bash", "-c", 'eval "set -- $1"; printf "%s\\0" "$@"', "-", out],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split("\0")[:-1] == expected


def test_flags_two_plugins_wanting_different_values_is_an_error(fresh_runtime):
    registry.register(Plugin(name="c-ppo", description="x",
                             command_line=(CommandLineFlag("--advantage-estimator ppo", "critic"),)))
    registry.register(Plugin(name="c-grpo", description="x",
                             command_line=(CommandLineFlag("--advantage-estimator grpo", "groups"),)))
    registry.register(Plugin(name="c-ppo2", description="x",
                             command_line=(CommandLineFlag("--advantage-estimator ppo", "also a critic"),)))
    with pytest.raises(registry.PluginError, match=r"'c-ppo' and 'c-grpo' need different values for --advantage-est"):
        config.build(["c-ppo", "c-grpo"])
    assert config.build(["c-ppo", "c-ppo2"]).flags == ["--advantage-estimator", "ppo"]  # same flag given once


# ---- config refuses what the start-up check would refuse ------------------------------------------
def test_config_refuses_dis_with_icepop_naming_the_conflict(tmp_path):
    out = tmp_path / "ascend.yaml"
    proc = _cli("dis", "icepop", "-o", str(out))
    assert proc.returncode == 2
    assert "'dis' cannot be enabled with 'icepop'" in proc.stderr and "ascend_dis_weight" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_config_set_writes_a_yaml_the_start_up_check_accepts(fresh_runtime, tmp_path, monkeypatch):
    from slime_ascend.plugins import runtime

    monkeypatch.delenv("SLIME_ASCEND_PLUGINS", raising=False)
    gen = config.build(["dis", "icepop"], config.parse_overrides(["ascend_dis_weight=mask"]))
    data = yaml.safe_load(gen.yaml_text)
    assert data["ascend_dis_weight"] == "mask"
    runtime.check(argparse.Namespace(**data))  # the validator the processes run accepts it
    data["ascend_dis_weight"] = "ratio"
    with pytest.raises(SettingsError, match="icepop"):
        runtime.check(argparse.Namespace(**data))


@pytest.mark.parametrize("names", [["dis"], ["icepop"], ["dis", "staleness"], ["npu", "sao"], ["opd"]])
def test_config_accepts_combinations_without_a_conflict(names):
    assert config.build(names).plugins[-1] == names[-1]


def test_config_set_names_the_closest_key_and_checks_the_value():
    with pytest.raises(SettingsError, match="did you mean 'ascend_dis_weight'"):
        config.build(["dis"], config.parse_overrides(["ascend_dis_weigth=mask"]))
    with pytest.raises(SettingsError, match="--set ascend_dis_weight: .*not an allowed choice"):
        config.build(["dis"], config.parse_overrides(["ascend_dis_weight=sometimes"]))
    with pytest.raises(SettingsError, match="expected KEY=VALUE"):
        config.parse_overrides(["ascend_dis_weight"])


# ---- the complete next step --------------------------------------------------------------------
def test_config_writes_sao_critic_role_file_and_prints_the_whole_launch_line(tmp_path):
    out = tmp_path / "ascend.yaml"
    cmd = [sys.executable, "-m", "slime_ascend.cli", "config", "npu", "sao", "--set",
           "ascend_sao_freeze_patterns=[self_attention, mlp.linear_fc1]", "-o", str(out)]
    first = subprocess.run(cmd, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    role = tmp_path / "sao_megatron.yaml"
    critic = [e for e in yaml.safe_load(role.read_text())["megatron"] if e["role"] == "critic"]
    assert critic[0]["overrides"]["freeze_params_name_list"] == ["self_attention", "mlp.linear_fc1"]  # the YAML's
    launch = first.stdout.strip().splitlines()[-1].strip()
    assert launch.startswith("SLIME_ASCEND_PLUGINS=npu,sao python $SLIME_SRC/train_async.py <your slime flags> ")
    for words in (f"--custom-config-path {out}", "--advantage-estimator ppo", "--n-samples-per-prompt 1",
                  f"--megatron-config-path {role}", "--rollout-function-path "
                  "slime.rollout.fully_async_rollout.generate_rollout_fully_async"):
        assert words in launch, (words, launch)
    # a second run without --force writes nothing and says which file is in the way
    out2 = tmp_path / "other.yaml"
    second = subprocess.run(cmd[:-1] + [str(out2)], capture_output=True, text=True)
    assert second.returncode == 2 and "sao_megatron.yaml exists" in second.stderr and "Fix:" in second.stderr
    assert not out2.exists()


def test_launch_line_keeps_values_only_the_user_knows_in_capitals():
    from slime_ascend import config

    line = config.build(["npu", "vllm-ascend"]).launch_line("/x/ascend.yaml")
    assert line.startswith("SLIME_ASCEND_PLUGINS=npu,vllm-ascend python $SLIME_SRC/train.py <your slime flags> ")
    assert "--rollout-external-engine-addrs HOST:PORT ..." in line and "--update-weight-disk-dir DIR" in line


def test_config_opd_names_the_empty_teacher_list_and_how_to_fill_it(tmp_path, capsys):
    """The YAML is written with ``ascend_opd_teachers: []`` (only the user knows the teachers), and one note line
    says so with the fix; given teachers, no such note."""
    from slime_ascend import cli

    assert cli.main(["config", "opd", "-o", str(tmp_path / "opd.yaml")]) == 0
    assert yaml.safe_load((tmp_path / "opd.yaml").read_text())["ascend_opd_teachers"] == []
    notes = [line for line in capsys.readouterr().err.splitlines() if "ascend_opd_teachers" in line]
    assert len(notes) == 1, notes
    assert notes[0].startswith("note: plugin 'opd' needs a value before the job can start: setting "
                               "ascend_opd_teachers is empty. Fix: add a teachers section to the YAML")
    assert "ascend_opd_teachers: [{name: math, checkpoint_dir:" in notes[0] and "--set KEY=VALUE" in notes[0]

    teachers = "ascend_opd_teachers=[{name: math, checkpoint_dir: /ckpt/math, domains: [math], url: 'http://h:1'}]"
    assert cli.main(["config", "opd", "--set", teachers, "-o", str(tmp_path / "filled.yaml")]) == 0
    assert "needs a value" not in capsys.readouterr().err


def test_two_sao_configs_each_in_its_own_directory(tmp_path, capsys):
    """SAO's config writes its critic role file (sao_megatron.yaml) beside the YAML, so two SAO configs in one
    directory collide: the second is refused, naming the file, and writes nothing. `-o DIR/ascend.yaml` gives each
    its own directory (created), and each launch line names its own role file."""
    from slime_ascend import cli

    assert cli.main(["config", "npu", "sglang-npu", "sao", "int8-sync", "-o", str(tmp_path / "sao.yaml")]) == 0
    capsys.readouterr()
    assert cli.main(["config", "npu", "sglang-npu", "sao", "staleness", "-o", str(tmp_path / "other.yaml")]) == 2
    assert f"{tmp_path / 'sao_megatron.yaml'} exists. Fix:" in capsys.readouterr().err
    assert not (tmp_path / "other.yaml").exists()

    lines = {}
    for name, plugins in (("sao-int8", ["sao", "int8-sync"]), ("sao-staleness", ["sao", "staleness"])):
        out = tmp_path / "own" / name / "ascend.yaml"
        assert cli.main(["config", "npu", "sglang-npu", *plugins, "-o", str(out)]) == 0
        assert (out.parent / "sao_megatron.yaml").is_file()
        lines[name] = capsys.readouterr().out.splitlines()[-1]
    for name, line in lines.items():
        own = tmp_path / "own" / name
        assert f"--custom-config-path {own / 'ascend.yaml'}" in line
        assert f"--megatron-config-path {own / 'sao_megatron.yaml'}" in line

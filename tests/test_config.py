import argparse
import subprocess
import sys

import pytest
import yaml

from slime_ascend import config
from slime_ascend.plugins import registry
from slime_ascend.plugins.base import CommandLineFlag, Contribution, Plugin
from slime_ascend.plugins.settings import Setting


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


def test_every_installed_plugin_config_loads():
    gen = config.build(["all"])
    data = yaml.safe_load(gen.yaml_text)
    for name in data["ascend_plugins"]:
        assert name in registry.available()
    for key, value in data.items():
        if key.endswith("_path") and value:
            for path in value if isinstance(value, list) else [value]:
                from slime_ascend.plugins.base import resolve

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

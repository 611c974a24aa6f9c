"""One quantiser: with a sync plugin on, qat's spec is the one the funnel quantises the push with (the rollout
checkpoint's group size and ignore rules, the plugin's numerics); settings that contradict it are refused in one
line at parse_args; without a sync plugin the settings build the spec `slime-ascend quantize` would. The YAML wires
slime's before-log-prob and before-train-step hooks to the plugin."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest

from slime_ascend.plugins.settings import SettingsError
from slime_ascend.qat.spec import resolve_spec, validate
from slime_ascend.quant.hf_config import quantization_config_for
from slime_ascend.quant.schemes import make_spec
from slime_ascend.weight_sync import funnel


def _settings(fmt="int4-group", group=None, numerics=None):
    return {"ascend_qat_format": fmt, "ascend_qat_group_size": group, "ascend_qat_numerics": numerics}


def _checkpoint(path: Path, spec, ignore=("lm_head",)) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3",
                                                  "quantization_config": quantization_config_for(spec, ignore)}))
    return path


@pytest.fixture(autouse=True)
def _fresh_caches():
    funnel.clear_caches()
    yield
    funnel.clear_caches()


def test_with_int4_sync_the_spec_is_the_pushed_one(tmp_path):
    ckpt = _checkpoint(tmp_path / "int4", make_spec("int4-group", group_size=32),
                       ignore=("lm_head", "re:.*layers\\.0\\.mlp\\..*"))
    args = Namespace(ascend_plugins=["int4-sync", "qat"], hf_checkpoint=str(ckpt),
                     ascend_int4_sync_numerics="torchao")
    spec = resolve_spec(args, _settings())
    assert spec == funnel.spec_for(args, funnel.checkpoint_format(args).config)  # the funnel's own spec
    assert spec.int_scheme.group_size == 32 and spec.int4_numerics == "torchao"
    assert spec.ignore == ("lm_head", "re:.*layers\\.0\\.mlp\\..*")
    assert resolve_spec(args, _settings(group=32, numerics="torchao")) == spec  # agreeing settings are fine
    with pytest.raises(SettingsError, match="ascend_qat_group_size 64 but int4-sync pushes groups of 32"):
        resolve_spec(args, _settings(group=64))
    with pytest.raises(SettingsError, match="ascend_qat_numerics compressed-tensors but int4-sync pushes torchao"):
        resolve_spec(args, _settings(numerics="compressed-tensors"))
    with pytest.raises(SettingsError, match="ascend_qat_format is fp8-block but int4-sync pushes int4-group.*"
                                            "Fix: set ascend_qat_format: int4-group"):
        resolve_spec(args, _settings(fmt="fp8-block"))


def test_with_fp8_sync_the_block_is_the_checkpoints(tmp_path):
    ckpt = _checkpoint(tmp_path / "fp8", make_spec("fp8-block", block_size=(64, 64)))
    args = Namespace(ascend_plugins=["fp8-sync", "qat"], hf_checkpoint=str(ckpt), ascend_qat_format="fp8-block")
    spec = resolve_spec(args, _settings(fmt="fp8-block"))
    assert spec.fp8.block_size == (64, 64) and spec == funnel.spec_for(args, funnel.checkpoint_format(args).config)


def test_without_a_sync_plugin_the_settings_make_the_spec():
    args = Namespace(ascend_plugins=["qat"], hf_checkpoint=None)
    assert resolve_spec(args, _settings()) == make_spec("int4-group", group_size=128)
    assert resolve_spec(args, _settings(group=64, numerics="slime")) == make_spec("int4-group", group_size=64,
                                                                                  numerics="slime")
    assert resolve_spec(args, _settings(fmt="int8-ct")) == make_spec("int8-ct")


def test_the_layout_check_reads_the_pushed_group_size(tmp_path):
    ckpt = _checkpoint(tmp_path / "int4", make_spec("int4-group", group_size=64))
    args = Namespace(ascend_plugins=["int4-sync", "qat"], hf_checkpoint=str(ckpt), tensor_model_parallel_size=2,
                     hidden_size=64, num_attention_heads=4, kv_channels=16, ffn_hidden_size=256, num_experts=None,
                     gradient_accumulation_fusion=False)
    with pytest.raises(SettingsError, match=r"linear_proj: its TP shard's input dim 32 .* group size 64"):
        validate(args, _settings())


def test_the_yaml_wires_both_train_hooks(tmp_path):
    import yaml

    from slime_ascend.cli import main

    out = tmp_path / "qat.yaml"
    assert main(["config", "qat", "-o", str(out)]) == 0
    cfg = yaml.safe_load(out.read_text())
    assert cfg["custom_megatron_before_log_prob_hook_path"] == "slime_ascend.hooks.before_log_prob"
    assert cfg["custom_megatron_before_train_step_hook_path"] == "slime_ascend.hooks.before_train_step"
    assert cfg["ascend_qat_format"] == "int4-group"

"""Rollout backends: options from plugin settings, plugin declarations, the reference backend."""

from __future__ import annotations

import json
import urllib.request

import pytest

from slime_ascend.rollout.backends import BackendError, sglang_npu, torch_engine


def test_options_defaults_overrides_and_bad_values():
    b = sglang_npu.BACKEND
    assert b.defaults()["attention_backend"] == "ascend"
    opts = b.options({"ascend_rollout_mem_fraction": "0.75", "graph_mode": "false"})
    assert opts["mem_fraction"] == 0.75 and opts["graph_mode"] is False
    with pytest.raises(BackendError, match="no option 'bogus'"):
        b.options({"bogus": 1})
    with pytest.raises(ValueError, match="ascend_rollout_mem_fraction"):
        b.options({"mem_fraction": 1.5})
    with pytest.raises(ValueError, match="LOW-HIGH"):
        b.options({"hccl_host_port_range": "60000"})


def test_options_from_args_reads_yaml_keys():
    import argparse

    b = sglang_npu.BACKEND
    args = argparse.Namespace(ascend_rollout_use_fia=False)
    opts = b.options_from_args(args)
    assert opts["use_fia"] is False and opts["attention_backend"] == "ascend"
    assert b.env(opts)["ASCEND_USE_FIA"] == "0"


def test_plugins_selectable_and_exclusive(fresh_runtime):
    from slime_ascend.plugins import registry

    sel = registry.resolve_selection(["sglang-npu"])
    assert sel.names == ("npu", "sglang-npu")  # requires npu
    assert registry.resolve_selection(["vllm-ascend"]).names == ("npu", "vllm-ascend")
    with pytest.raises(registry.PluginError, match="cannot be enabled together"):
        registry.resolve_selection(["sglang-npu", "vllm-ascend"])
    assert "engine.sglang_npu_launch" in sel.get("sglang-npu").patch_ids


def test_config_yaml_for_sglang_npu_has_settings():
    import yaml

    from slime_ascend import config

    generated = config.build(["sglang-npu"])
    data = yaml.safe_load(generated.yaml_text)
    assert data["ascend_plugins"] == ["npu", "sglang-npu"]
    assert data["ascend_rollout_attention_backend"] == "ascend"
    assert data["ascend_rollout_mem_fraction"] is None
    vllm = config.build(["vllm-ascend"])
    assert any(flag.startswith("--rollout-external-engine-addrs") for flag, _, _ in vllm.command_line)


def test_vllm_plugin_command_line_checks():
    import argparse

    from slime_ascend.rollout.plugin import VLLM_ASCEND

    ext, disk = VLLM_ASCEND.command_line
    assert not ext.check(argparse.Namespace(rollout_external_engine_addrs=None))
    assert ext.check(argparse.Namespace(rollout_external_engine_addrs=["h:1"]))
    assert not disk.check(argparse.Namespace(update_weight_transport="nccl", update_weight_disk_dir="/x"))
    assert disk.check(argparse.Namespace(update_weight_transport="disk", update_weight_disk_dir="/x"))


def test_torch_engine_backend_serves_slime_discovery_fields():
    b = torch_engine.BACKEND
    assert b.slime_flags({}, ["h:1"])[:2] == ["--rollout-external-engine-addrs", "h:1"]
    with torch_engine.serve(seed=0) as addr:
        info = json.loads(urllib.request.urlopen(f"http://{addr}/server_info", timeout=30).read())
        # the fields slime's external discovery and server-args sanity check read
        assert info["tp_size"] == 1 and info["enable_memory_saver"] is False
        assert info["disaggregation_mode"] == "null"
        req = urllib.request.Request(
            f"http://{addr}/generate",
            data=json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "temperature": 0.0},
                             "return_logprob": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        out = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"]) <= 3


@pytest.mark.slime
def test_torch_engine_backend_through_slime_external_discovery():
    from slime.backends.sglang_utils.external import discover_external_engines

    with torch_engine.serve(seed=0) as addr:
        (info,) = discover_external_engines([addr])
        assert info.worker_type == "regular" and info.num_gpus == 1
        assert info.parallel_config == {"tp_size": 1, "pp_size": 1, "ep_size": 1, "moe_dp_size": 1}

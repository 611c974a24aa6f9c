"""The sync funnel reproduces the offline converter bit for bit, per format, and declines configs
that are not the enabled plugin's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _ws_helpers import hf_tensors, plugin_for, quant_config, sync_args, write_hf  # noqa: E402

from slime_ascend.plugins import runtime  # noqa: E402
from slime_ascend.plugins.settings import SettingsError  # noqa: E402
from slime_ascend.quant.checkpoint import CheckpointReader, convert_checkpoint, tensors_bit_equal  # noqa: E402
from slime_ascend.weight_sync import funnel, metrics  # noqa: E402
from slime_ascend.weight_sync.engine_gate import PostProcessGate, slime_gate_opens, source_config  # noqa: E402

SRC = hf_tensors()
# the formats of the four sync plugins
FORMATS = tuple(f for fmts in funnel.PLUGIN_FORMATS.values() for f in fmts)


def fresh(args):
    """slime passes one args per process; plugin settings are validated once per process."""
    runtime.reset()
    funnel.clear_caches()
    return args


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws")
    hf = write_hf(root / "hf", SRC)
    out = {"hf": hf}
    for fmt in FORMATS:
        convert_checkpoint(hf, root / fmt, fmt)
        out[fmt] = root / fmt
    return out


@pytest.fixture(autouse=True)
def _clean(fresh_runtime):
    funnel.clear_caches()
    metrics.reset()
    yield
    funnel.clear_caches()
    metrics.reset()


@pytest.mark.parametrize("fmt", FORMATS)
def test_funnel_equals_offline_converter(fmt, ckpts):
    args = sync_args(plugin_for(fmt), ckpts[fmt])
    qc = quant_config(ckpts[fmt])
    assert (qc is None) == (fmt in funnel.DESCRIPTION_FORMATS)  # msModelSlim: no quantization_config, a description file
    reader = CheckpointReader(ckpts[fmt])
    seen = set()
    for name, t in SRC.items():
        out = funnel.quantize_params(args, "module.module.x", [(name, t)], qc)
        assert out is not None
        for out_name, out_t in out:
            assert out_name in reader, out_name
            assert tensors_bit_equal(out_t, reader.get(out_name)), out_name
            seen.add(out_name)
    assert seen == set(reader.keys())
    # what stays in the model dtype: embeddings, norms, lm_head
    for keep in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight"):
        assert reader.get(keep).dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", FORMATS)
def test_check_engine_format_accepts_own_rejects_others(fmt, ckpts):
    plugin = plugin_for(fmt)
    assert funnel.check_engine_format(fresh(sync_args(plugin, ckpts[fmt])), plugin).fmt == fmt
    for other in ("fp8-sync", "int8-sync", "int4-sync"):
        if other == plugin:
            continue
        with pytest.raises(SettingsError, match=f"slime-ascend quantize HF_DIR OUT_DIR --format"):
            funnel.check_engine_format(fresh(sync_args(other, ckpts[fmt])), other)
    with pytest.raises(SettingsError, match="unquantised"):
        funnel.check_engine_format(fresh(sync_args(plugin, ckpts["hf"])), plugin)


def test_int8_format_setting_pins_the_format(ckpts):
    args = fresh(sync_args("int8-sync", ckpts["int8-ct"], ascend_int8_sync_format="int8-w8a8"))
    with pytest.raises(SettingsError, match="int8-w8a8"):
        funnel.check_engine_format(args, "int8-sync")


def test_funnel_declines_other_configs(ckpts):
    t = SRC["model.layers.0.mlp.up_proj.weight"]
    # int8-sync enabled, an FP8 checkpoint config arrives: not ours -> slime's quantizer
    args = fresh(sync_args("int8-sync", ckpts["int8-ct"]))
    assert funnel.quantize_params(args, "n", [("model.layers.0.mlp.up_proj.weight", t)],
                                  quant_config(ckpts["fp8-block"])) is None
    # None config and a non-Ascend checkpoint: slime sends BF16
    assert funnel.quantize_params(fresh(sync_args("fp8-sync", ckpts["fp8-block"])), "n",
                                  [("model.layers.0.mlp.up_proj.weight", t)], None) is None
    # a ue8m0 FP8 config is slime's (DeepGEMM) path
    qc = dict(quant_config(ckpts["fp8-block"]), scale_fmt="ue8m0")
    assert funnel.quantize_params(fresh(sync_args("fp8-sync", ckpts["fp8-block"])), "n",
                                  [("model.layers.0.mlp.up_proj.weight", t)], qc) is None
    # an unknown method
    assert funnel.quantize_params(fresh(sync_args("int4-sync", ckpts["int4-group"])), "n",
                                  [("model.layers.0.mlp.up_proj.weight", t)], {"quant_method": "mxfp4"}) is None


def test_gate_config_is_unwrapped(ckpts):
    name = "model.layers.0.mlp.up_proj.weight"
    args = sync_args("int8-sync", ckpts["int8-w8a8"])
    gate = PostProcessGate(None)
    assert slime_gate_opens(gate) and source_config(gate) is None and not slime_gate_opens(None)
    out = dict(funnel.quantize_params(args, "n", [(name, SRC[name])], gate))
    ref = CheckpointReader(ckpts["int8-w8a8"])
    assert set(out) == {name, name[:-6] + "weight_scale", name[:-6] + "weight_offset"}
    assert all(tensors_bit_equal(v, ref.get(k)) for k, v in out.items())
    ct = quant_config(ckpts["int8-ct"])
    assert source_config(PostProcessGate(ct)) is ct and PostProcessGate(ct)["quant_method"] == "compressed-tensors"


def test_engine_post_process_only_where_slime_misses_it(ckpts):
    assert funnel.needs_engine_post_process(fresh(sync_args("int8-sync", ckpts["int8-w8a8"])), None)
    assert not funnel.needs_engine_post_process(
        fresh(sync_args("int8-sync", ckpts["int8-w8a8"], ascend_int8_sync_engine_post_process=False)), None)
    # compressed-tensors: slime's own gate opens
    assert not funnel.needs_engine_post_process(fresh(sync_args("int8-sync", ckpts["int8-ct"])), quant_config(ckpts["int8-ct"]))
    assert not funnel.needs_engine_post_process(fresh(sync_args("fp8-sync", ckpts["fp8-block"])),
                                                quant_config(ckpts["fp8-block"]))


def test_metrics_bytes_time_and_rates(ckpts):
    args = sync_args("int4-sync", ckpts["int4-group"])
    qc = quant_config(ckpts["int4-group"])
    named = [(k, SRC[k]) for k in ("model.layers.0.mlp.up_proj.weight", "model.norm.weight")]
    with metrics.sync_timer():
        with metrics.sync_timer():  # nested: one sync
            out = funnel.quantize_params(args, "n", named, qc)
    m = metrics.drain()
    assert m["perf/weight_sync_bytes"] == sum(t.numel() * t.element_size() for _, t in out)
    assert m["perf/weight_sync_source_bytes"] == sum(t.numel() * t.element_size() for _, t in named)
    assert m["perf/weight_sync_quantized_params"] == 1 and m["perf/weight_sync_count"] == 1
    assert m["perf/weight_sync_quant_time"] > 0 and m["perf/weight_sync_time"] >= m["perf/weight_sync_quant_time"]
    assert m["perf/weight_sync_quant_gbps"] == pytest.approx(
        m["perf/weight_sync_source_bytes"] / m["perf/weight_sync_quant_time"] / 1e9)
    assert m["perf/weight_sync_gbps"] == pytest.approx(m["perf/weight_sync_bytes"] / m["perf/weight_sync_time"] / 1e9)
    assert metrics.drain() == {}  # drained


def test_metrics_off(ckpts):
    args = fresh(sync_args("fp8-sync", ckpts["fp8-block"], ascend_fp8_sync_metrics=False))
    funnel.quantize_params(args, "n", [("model.layers.0.mlp.up_proj.weight", SRC["model.layers.0.mlp.up_proj.weight"])],
                           quant_config(ckpts["fp8-block"]))
    assert metrics.drain() == {}


def test_int4_numerics_setting_changes_the_bytes(ckpts):
    name = "model.layers.0.mlp.up_proj.weight"
    qc = quant_config(ckpts["int4-group"])
    a = dict(funnel.quantize_params(fresh(sync_args("int4-sync", ckpts["int4-group"])), "n", [(name, SRC[name])], qc))
    funnel.clear_caches()
    b = dict(funnel.quantize_params(fresh(sync_args("int4-sync", ckpts["int4-group"], ascend_int4_sync_numerics="slime")),
                                    "n", [(name, SRC[name])], qc))
    assert not torch.equal(a[name[:-6] + "weight_scale"], b[name[:-6] + "weight_scale"])


@pytest.mark.parametrize("plugin", ["fp8-sync", "int8-sync", "int4-sync"])
def test_an_unquantised_engine_checkpoint_stops_the_driver_in_one_line(plugin, ckpts, capsys):
    """Checked where the driver first holds args (slime's parse_args, wrapped by driver.validate_at_parse_args), so the job stops
    before Ray and the engines start, not as a Ray traceback from the train actor's megatron_init."""
    from slime_ascend.startup import early

    args = fresh(sync_args(plugin, ckpts["hf"]))
    with pytest.raises(SettingsError, match="is unquantised"):
        runtime.check(args)
    with pytest.raises(SystemExit) as info:
        early.entered(args, "driver")  # what the driver.validate_at_parse_args patch runs on parse_args' result
    assert info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"slime-ascend: error: plugin {plugin!r} syncs") and "Fix:" in lines[0]
    key = f"ascend_{plugin.replace('-', '_')}_check_engine_format"
    runtime.check(fresh(sync_args(plugin, ckpts["hf"], **{key: False})))  # the documented way out


@pytest.mark.parametrize("fmt", ["fp8-block", "int4-group"])
def test_an_mtp_layer_goes_by_the_same_rules_online_and_offline(fmt, tmp_path):
    """GLM-5's MTP layer (``model.layers.<num_hidden_layers>.*``, what slime pushes with ``--mtp-num-layers``): each
    tensor the sync funnel makes of it is byte-identical to ``slime-ascend quantize``'s (its decoder linears quantised,
    ``eh_proj``, the norms and the head norm kept), as every other layer's."""
    g = torch.Generator().manual_seed(7)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    h = SRC["model.embed_tokens.weight"].shape[1]
    mtp = {"model.layers.2.eh_proj.weight": r(h, 2 * h), "model.layers.2.enorm.weight": r(h),
           "model.layers.2.hnorm.weight": r(h), "model.layers.2.shared_head.norm.weight": r(h),
           "model.layers.2.self_attn.q_proj.weight": r(h, h), "model.layers.2.mlp.down_proj.weight": r(h, 2 * h)}
    hf = write_hf(tmp_path / "hf", {**SRC, **mtp})
    convert_checkpoint(hf, tmp_path / fmt, fmt)
    args = sync_args(plugin_for(fmt), tmp_path / fmt)
    reader = CheckpointReader(tmp_path / fmt)
    for name, t in mtp.items():
        out = funnel.quantize_params(args, "module.module.mtp.layers.0.x", [(name, t)], quant_config(tmp_path / fmt))
        assert out is not None
        for out_name, out_t in out:
            assert out_name in reader and tensors_bit_equal(out_t, reader.get(out_name)), out_name
        names = {n for n, _ in out}
        if name.endswith(("q_proj.weight", "down_proj.weight")):
            assert names != {name} or reader.get(name).dtype != torch.bfloat16, (name, names)  # quantised
        else:
            assert names == {name} and reader.get(name).dtype == torch.bfloat16, (name, names)  # kept

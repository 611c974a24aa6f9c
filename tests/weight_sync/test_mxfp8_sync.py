"""mxfp8-sync (one of weight_sync.plugin's sync plugins): the funnel's MXFP8 tensors equal the offline converter's
bytes; declines what is not ours; declares the collective patches of the other three."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _ws_helpers import hf_tensors, sync_args, write_hf  # noqa: E402

from slime_ascend.plugins import registry  # noqa: E402
from slime_ascend.plugins.base import resolve  # noqa: E402
from slime_ascend.plugins.settings import SettingsError  # noqa: E402
from slime_ascend.quant.checkpoint import CheckpointReader, convert_checkpoint, tensors_bit_equal  # noqa: E402
from slime_ascend.weight_sync import funnel, metrics  # noqa: E402
from slime_ascend.weight_sync.plugin import MXFP8_SYNC, PATCHES  # noqa: E402
from slime_ascend.weight_sync.engine_gate import PostProcessGate  # noqa: E402

SRC = hf_tensors()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("mx")
    hf = write_hf(root / "hf", SRC)
    convert_checkpoint(hf, root / "mxfp8", "mxfp8")
    convert_checkpoint(hf, root / "fp8", "fp8-block")
    return {"hf": hf, "mxfp8": root / "mxfp8", "fp8": root / "fp8"}


@pytest.fixture(autouse=True)
def _clean(fresh_runtime):
    registry.register(MXFP8_SYNC)  # (an installed checkout has the entry point as well)
    funnel.clear_caches()
    metrics.reset()
    yield
    funnel.clear_caches()
    metrics.reset()


def test_online_bytes_equal_offline_converter(ckpts):
    args = sync_args("mxfp8-sync", ckpts["mxfp8"])
    assert json.loads((ckpts["mxfp8"] / "config.json").read_text()).get("quantization_config") is None
    reader = CheckpointReader(ckpts["mxfp8"])
    seen = set()
    for name, t in SRC.items():
        out = funnel.quantize_params(args, "module.module.x", [(name, t)], None)
        assert out is not None
        for out_name, out_t in out:
            assert tensors_bit_equal(out_t, reader.get(out_name)), out_name
            seen.add(out_name)
    assert seen == set(reader.keys())
    q = reader.get("model.layers.0.mlp.down_proj.weight")
    s = reader.get("model.layers.0.mlp.down_proj.weight_scale")
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8 and s.shape == (q.shape[0], q.shape[1] // 32)
    assert reader.get("lm_head.weight").dtype == torch.bfloat16  # the name policy: kept in the model dtype
    # a whole bucket, as slime's convert_to_hf hands it over, through the PostProcessGate wrapper too
    bucket = [(k, SRC[k]) for k in list(SRC)[:8]]
    for cfg in (None, PostProcessGate(None)):
        for out_name, out_t in funnel.quantize_params(args, "x", bucket, cfg):
            assert tensors_bit_equal(out_t, reader.get(out_name)), out_name
    snap = metrics.snapshot()
    assert snap[metrics.PREFIX + "quantized_params"] > 0 and snap[metrics.PREFIX + "bytes"] > 0


def test_declines_what_is_not_ours(ckpts):
    fp8_cfg = json.loads((ckpts["fp8"] / "config.json").read_text())["quantization_config"]
    args = sync_args("mxfp8-sync", ckpts["mxfp8"])
    assert funnel.quantize_params(args, "x", [("a.weight", SRC["lm_head.weight"])], fp8_cfg) is None
    off = sync_args("fp8-sync", ckpts["fp8"])  # plugin not enabled
    assert funnel.quantize_params(off, "x", [("a.weight", SRC["lm_head.weight"])], None) is None


def test_validate_refuses_another_format(ckpts):
    args = sync_args("mxfp8-sync", ckpts["fp8"])
    with pytest.raises(SettingsError, match=r"syncs mxfp8, but .* is fp8-block.*--format mxfp8"):
        funnel.validate(args, {"ascend_mxfp8_sync_check_engine_format": True})
    funnel.validate(args, {"ascend_mxfp8_sync_check_engine_format": False})
    funnel.validate(sync_args("mxfp8-sync", ckpts["mxfp8"]), {"ascend_mxfp8_sync_check_engine_format": True})


@pytest.mark.parametrize("other", ["fp8-sync", "int8-sync", "int4-sync"])
def test_conflicts_with_other_sync_plugins(other):
    with pytest.raises(Exception, match="conflict"):
        registry.resolve_selection(["mxfp8-sync", other])


def test_declaration():
    sel = registry.resolve_selection(["mxfp8-sync"])
    assert [p for p, _ in sel.slots["quantize_params"]] == ["mxfp8-sync"]
    p = MXFP8_SYNC
    assert {c.slot for c in p.contributions} == {"quantize_params", "megatron_init"}
    for c in p.contributions:
        assert callable(c.load())
    # the same chain as the other sync plugins: float8 over gloo and every collective push acknowledged
    assert set(p.patch_ids) == {u.patch for u in PATCHES} >= {"train.gloo_float8_broadcast",
                                                           "driver.acknowledged_collective_update"}
    assert resolve("slime_ascend.weight_sync.plugin:MXFP8_SYNC") is p
    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert 'mxfp8-sync = "slime_ascend.weight_sync.plugin:MXFP8_SYNC"' in text

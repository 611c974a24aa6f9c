"""quantization_config builders match compressed-tensors' own serialisation; format detection."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import need
from slime_ascend.quant import (
    ascend_quant_description, ct_int4_quantization_config, ct_int8_quantization_config,
    format_from_quantization_config, fp8_block_quantization_config, spec_from_quantization_config,
)


def library_config(preset: str, fmt: str, ignore, tmp_path):
    ct = need("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, format=fmt,
                            quantization_status="compressed", ignore=list(ignore))
    (tmp_path / "config.json").write_text("{}")
    ModelCompressor(quantization_config=qc).update_config(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg.pop("version") == ct.__version__
    return cfg


IGN = ["lm_head", "model.layers.0.mlp.gate"]


@pytest.mark.parametrize("preset,fmt,ours", [
    ("W8A8", "int-quantized", lambda: ct_int8_quantization_config(IGN)),
    ("W4A16", "pack-quantized", lambda: ct_int4_quantization_config(128, True, IGN)),
    ("W4A16_ASYM", "pack-quantized", lambda: ct_int4_quantization_config(128, False, IGN)),
])
def test_ct_configs_equal_library_output(preset, fmt, ours, tmp_path):
    lib = library_config(preset, fmt, IGN, tmp_path)
    mine = ours()
    assert mine.pop("version")
    assert mine == lib


def test_fp8_config_shape():
    cfg = fp8_block_quantization_config((128, 128), ["lm_head", "model.embed_tokens"])
    assert cfg == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                   "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", "model.embed_tokens"]}


def test_ascend_description():
    d = ascend_quant_description({"a.weight": "W8A8_DYNAMIC", "a.weight_scale": "W8A8_DYNAMIC", "n.weight": "FLOAT"})
    assert d["model_quant_type"] == "W8A8_DYNAMIC" and d["version"] == "1.0.0"
    assert d["a.weight"] == "W8A8_DYNAMIC" and d["n.weight"] == "FLOAT"
    assert format_from_quantization_config(d) == "int8-w8a8"
    spec = spec_from_quantization_config(d)
    assert spec.fmt == "int8-w8a8" and "n" in spec.ignore and "a" not in spec.ignore


def test_format_detection_and_spec_round_trip():
    assert format_from_quantization_config(None) is None
    assert format_from_quantization_config({"quant_method": "mxfp4"}) is None
    per_tensor_fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    assert format_from_quantization_config(per_tensor_fp8) is None
    assert format_from_quantization_config(fp8_block_quantization_config((64, 32))) == "fp8-block"
    assert spec_from_quantization_config(fp8_block_quantization_config((64, 32))).fp8.block_size == (64, 32)
    assert spec_from_quantization_config(fp8_block_quantization_config()).ignore is None
    assert format_from_quantization_config(ct_int8_quantization_config()) == "int8-ct"
    c4 = ct_int4_quantization_config(32, False, ["lm_head"])
    assert format_from_quantization_config(c4) == "int4-group"
    s4 = spec_from_quantization_config(c4)
    assert s4.int_scheme.group_size == 32 and not s4.int_scheme.symmetric and s4.ignore == ("lm_head",)
    fp8_ct = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}
    assert format_from_quantization_config(fp8_ct) is None
    assert spec_from_quantization_config(ct_int8_quantization_config()).int_scheme.scale_round_dtype is None
    assert torch.float32 == spec_from_quantization_config(
        ascend_quant_description({"a.weight": "W8A8_DYNAMIC"})).int_scheme.scale_store_dtype

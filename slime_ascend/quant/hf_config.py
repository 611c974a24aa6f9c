"""`quantization_config` / `quant_model_description.json` builders and parsers.

- fp8-block: `{"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
  "weight_block_size": [bn, bk], "modules_to_not_convert": [...]}` (slime's
  `tools/convert_hf_to_fp8.py`).
- int8-ct / int4-group: the dict compressed-tensors' `ModelCompressor.update_config` writes
  (library 0.20.x: W8A8 / W4A16 / W4A16_ASYM preset schemes, `quantization_status`
  "compressed", `format` "int-quantized" / "pack-quantized").
- int8-w8a8 (Ascend): no `quantization_config` in config.json (msModelSlim removes it); a
  `quant_model_description.json` maps every tensor name to "W8A8_DYNAMIC" or "FLOAT" plus
  `version`, `model_quant_type`, `metadata`, `group_size`, `optional` (msModelSlim
  `ascendv1_saver`).
- mxfp8 (Ascend): the same description with "W8A8_MXFP8" for each quantised tensor (msModelSlim's
  MXFP8 export, which SGLang's and vllm-ascend's ModelSlim loaders read).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping
from typing import Any

from .name_policy import module_of
from .schemes import FP8_BLOCK, INT4_GROUP, INT8_CT, INT8_W8A8, MXFP8, QuantSpec, make_spec

CT_VERSION = "0.20.1"  # compressed-tensors release whose serialisation these dicts reproduce
ASCEND_DESCRIPTION_FILE = "quant_model_description.json"
ASCEND_W8A8_DYNAMIC = "W8A8_DYNAMIC"
ASCEND_FLOAT = "FLOAT"
ASCEND_W8A8_MXFP8 = "W8A8_MXFP8"
ASCEND_QUANT_TYPES = {INT8_W8A8: ASCEND_W8A8_DYNAMIC, MXFP8: ASCEND_W8A8_MXFP8}  # formats written as a description


def fp8_block_quantization_config(
    block_size: tuple[int, int] = (128, 128), modules_to_not_convert: Iterable[str] | None = None
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [int(block_size[0]), int(block_size[1])],
    }
    if modules_to_not_convert:
        cfg["modules_to_not_convert"] = sorted(set(modules_to_not_convert))
    return cfg


def _ct_config(weights: dict[str, Any], input_activations: dict[str, Any] | None, fmt: str,
               ignore: Iterable[str]) -> dict[str, Any]:
    return {
        "config_groups": {
            "group_0": {
                "format": None,
                "input_activations": input_activations,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": weights,
            }
        },
        "format": fmt,
        "global_compression_ratio": None,
        "ignore": sorted(set(ignore)),
        "kv_cache_scheme": None,
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }


def ct_int8_quantization_config(ignore: Iterable[str] = ("lm_head",)) -> dict[str, Any]:
    """compressed-tensors W8A8: int8 per-channel symmetric weights, dynamic per-token int8 activations."""
    weights = {"dynamic": False, "group_size": None, "num_bits": 8, "strategy": "channel",
               "symmetric": True, "type": "int"}
    acts = {"dynamic": True, "group_size": None, "num_bits": 8, "strategy": "token",
            "symmetric": True, "type": "int"}
    return _ct_config(weights, acts, "int-quantized", ignore)


def ct_int4_quantization_config(
    group_size: int = 128, symmetric: bool = True, ignore: Iterable[str] = ("lm_head",)
) -> dict[str, Any]:
    """compressed-tensors W4A16 (symmetric) / W4A16_ASYM: int4 group weights, bf16 activations."""
    weights = {"dynamic": False, "group_size": int(group_size), "num_bits": 4, "strategy": "group",
               "symmetric": bool(symmetric), "type": "int"}
    return _ct_config(weights, None, "pack-quantized", ignore)


def quantization_config_for(spec: QuantSpec, ignore: Iterable[str]) -> dict[str, Any] | None:
    """The config.json `quantization_config` of `spec` (None for the Ascend format)."""
    if spec.fmt == FP8_BLOCK:
        return fp8_block_quantization_config(spec.fp8.block_size, ignore)
    if spec.fmt == INT8_CT:
        return ct_int8_quantization_config(ignore)
    if spec.fmt == INT4_GROUP:
        return ct_int4_quantization_config(spec.int_scheme.group_size, spec.int_scheme.symmetric, ignore)
    return None


def ascend_quant_description(
    tensor_types: Mapping[str, str], quant_type: str = ASCEND_W8A8_DYNAMIC
) -> dict[str, Any]:
    """msModelSlim `quant_model_description.json` for a W8A8_DYNAMIC (or `quant_type`) checkpoint."""
    desc: dict[str, Any] = dict(tensor_types)
    quantized = any(v == quant_type for v in tensor_types.values())
    desc["version"] = "1.0.0"
    desc["model_quant_type"] = quant_type if quantized else ASCEND_FLOAT
    desc["metadata"] = {}
    desc["group_size"] = 0
    desc["optional"] = {}
    return desc


def _is_ascend_description(cfg: Mapping[str, Any]) -> bool:
    return "model_quant_type" in cfg and "quant_method" not in cfg


def format_from_quantization_config(cfg: Mapping[str, Any] | None) -> str | None:
    """Detect our format name from a `quantization_config` dict or an Ascend description.

    Returns one of FORMATS, or None when `cfg` is None / another (unsupported) method.
    """
    if not cfg:
        return None
    if _is_ascend_description(cfg):
        return {v: k for k, v in ASCEND_QUANT_TYPES.items()}.get(cfg.get("model_quant_type"))
    method = cfg.get("quant_method")
    if method == "fp8":
        if cfg.get("fmt", "e4m3") == "e4m3" and cfg.get("weight_block_size"):
            return FP8_BLOCK
        return None
    if method == "compressed-tensors":
        groups = cfg.get("config_groups") or {}
        if len(groups) != 1:
            return None
        w = (next(iter(groups.values())) or {}).get("weights") or {}
        if w.get("type", "int") != "int":
            return None
        if w.get("num_bits") == 8 and w.get("strategy") == "channel" and w.get("symmetric", True) \
                and cfg.get("format") in ("int-quantized", "naive-quantized"):
            return INT8_CT
        if w.get("num_bits") == 4 and w.get("strategy") == "group" and cfg.get("format") == "pack-quantized":
            return INT4_GROUP
    return None


def spec_from_quantization_config(
    cfg: Mapping[str, Any] | None, numerics: str = "compressed-tensors"
) -> QuantSpec | None:
    """The QuantSpec that reproduces a checkpoint's format, ignore rules included (None if not ours)."""
    fmt = format_from_quantization_config(cfg)
    if fmt is None:
        return None
    if fmt in ASCEND_QUANT_TYPES:
        ignore = [module_of(k) for k, v in cfg.items()
                  if isinstance(v, str) and k.endswith(".weight") and v != ASCEND_QUANT_TYPES[fmt]]
        return make_spec(fmt, ignore=ignore)
    if fmt == FP8_BLOCK:
        bs = cfg["weight_block_size"]
        return make_spec(fmt, block_size=(int(bs[0]), int(bs[1])), ignore=cfg.get("modules_to_not_convert"))
    if fmt == INT8_CT:
        return make_spec(fmt, ignore=cfg.get("ignore"))
    w = next(iter(cfg["config_groups"].values()))["weights"]
    return make_spec(fmt, group_size=int(w.get("group_size") or 128), symmetric=bool(w.get("symmetric", True)),
                     numerics=numerics, ignore=cfg.get("ignore"))


def read_checkpoint_quant_config(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """config.json `quantization_config`, else the Ascend description, else None."""
    path = os.fspath(path)
    cfg_file = os.path.join(path, "config.json")
    if os.path.exists(cfg_file):
        qc = _json_file(cfg_file).get("quantization_config")
        if qc:
            return copy.deepcopy(qc)
    desc_file = os.path.join(path, ASCEND_DESCRIPTION_FILE)
    if os.path.exists(desc_file):
        return _json_file(desc_file)
    return None


def _json_file(path: str) -> dict[str, Any]:
    """A checkpoint's JSON-object file; ValueError naming it (bad JSON, not an object, a FIFO, too big)."""
    from ..files import read_json_object

    try:
        return read_json_object(path)
    except ValueError as exc:
        raise ValueError(f"{exc}. Fix: restore the checkpoint's {os.path.basename(path)} (a JSON object)") from None


def format_from_checkpoint(path: str | os.PathLike[str]) -> str | None:
    return format_from_quantization_config(read_checkpoint_quant_config(path))


def spec_from_checkpoint(path: str | os.PathLike[str], numerics: str = "compressed-tensors") -> QuantSpec | None:
    return spec_from_quantization_config(read_checkpoint_quant_config(path), numerics)

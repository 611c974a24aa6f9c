"""HF-named tensors in, quantised HF-named tensors out (the weight-sync funnel's entry point).

Output names per format, for a quantised `X.weight` of shape [.., N, K]:
- fp8-block:  `X.weight` float8_e4m3fn, `X.weight_scale_inv` fp32 [.., ceil(N/bn), ceil(K/bk)]
- int8-w8a8:  `X.weight` int8, `X.weight_scale` fp32 [.., N, 1] (values rounded to the model
              dtype), `X.weight_offset` fp32 zeros [.., N, 1]          (msModelSlim W8A8_DYNAMIC)
- int8-ct:    `X.weight` int8, `X.weight_scale` model dtype [.., N, 1]   (compressed-tensors)
- int4-group: `X.weight_packed` int32 [.., N, ceil(K/8)], `X.weight_scale` model dtype
              [.., N, K/g], `X.weight_shape` int64 [ndim], and for asymmetric
              `X.weight_zero_point` int32 [.., ceil(N/8), K/g]         (compressed-tensors)
- mxfp8:      `X.weight` float8_e4m3fn, `X.weight_scale` uint8 E8M0 [.., N, K/32]  (msModelSlim W8A8_MXFP8)
Names that are not quantised pass through unchanged (same tensor object).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .fp8_block import dequantize_fp8_block, quantize_fp8_block
from .hf_config import spec_from_quantization_config
from .mxfp8 import dequantize_mxfp8, quantize_mxfp8
from .int_quant import (
    dequantize_int, pack_int4, pack_int4_zero_point, quantize_int, unpack_int4, unpack_int4_zero_point,
)
from .name_policy import should_quantize
from .schemes import FP8_BLOCK, INT4_GROUP, INT8_CT, INT8_W8A8, MXFP8, QuantSpec, make_spec

SpecLike = QuantSpec | str | Mapping[str, Any]


def as_spec(spec: SpecLike) -> QuantSpec:
    """A QuantSpec, a format name (see FORMATS) or a checkpoint `quantization_config` dict."""
    if isinstance(spec, QuantSpec):
        return spec
    if isinstance(spec, str):
        return make_spec(spec)
    if isinstance(spec, Mapping):
        out = spec_from_quantization_config(spec)
        if out is None:
            raise ValueError(f"quantization config is not one of our formats: {dict(spec)!r}")
        return out
    raise TypeError(f"spec must be a QuantSpec, format name or quantization_config dict, got {type(spec).__name__}")


def _base(name: str) -> str:
    if not name.endswith(".weight"):
        raise ValueError(f"{name}: only `.weight` parameters can be quantised")
    return name[: -len("weight")]


def quantize_param(name: str, weight: torch.Tensor, spec: SpecLike) -> list[tuple[str, torch.Tensor]]:
    """Quantise one `.weight` tensor (no name policy) into the format's tensors."""
    spec = as_spec(spec)
    base = _base(name)
    if spec.fmt == FP8_BLOCK:
        q, s = quantize_fp8_block(weight, spec.fp8, name=name)
        return [(name, q), (base + "weight_scale_inv", s)]
    if spec.fmt == MXFP8:
        q, s = quantize_mxfp8(weight, name=name)
        return [(name, q), (base + "weight_scale", s)]
    r = quantize_int(weight, spec.int_scheme, name=name)
    if spec.fmt == INT8_W8A8:
        return [(name, r.q), (base + "weight_scale", r.scale), (base + "weight_offset", torch.zeros_like(r.scale))]
    if spec.fmt == INT8_CT:
        return [(name, r.q), (base + "weight_scale", r.scale)]
    out = [
        (base + "weight_packed", pack_int4(r.q)),
        (base + "weight_scale", r.scale),
        (base + "weight_shape", torch.tensor(tuple(weight.shape), dtype=torch.int64, device=weight.device)),
    ]
    if r.zero_point is not None:
        out.append((base + "weight_zero_point", pack_int4_zero_point(r.zero_point)))
    return out


def quantize_named_params(
    named_params: Iterable[tuple[str, torch.Tensor]], fmt_spec: SpecLike
) -> list[tuple[str, torch.Tensor]]:
    """Quantise the parameters the spec's name policy selects; pass the rest through."""
    spec = as_spec(fmt_spec)
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in named_params:
        if should_quantize(name, t.dim(), spec.ignore, spec.extra_ignore):
            out.extend(quantize_param(name, t, spec))
        else:
            out.append((name, t))
    return out


def dequantize_param(
    base: str, tensors: Mapping[str, torch.Tensor], spec: SpecLike, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Rebuild `<base>weight` from its quantised tensors (`base` ends with '.' or is '')."""
    spec = as_spec(spec)
    if spec.fmt == FP8_BLOCK:
        return dequantize_fp8_block(tensors[base + "weight"], tensors[base + "weight_scale_inv"],
                                    spec.fp8.block_size, dtype)
    if spec.fmt == MXFP8:
        return dequantize_mxfp8(tensors[base + "weight"], tensors[base + "weight_scale"], dtype)
    if spec.fmt in (INT8_W8A8, INT8_CT):
        off = tensors.get(base + "weight_offset")
        if off is not None and bool((off == 0).all()):
            off = None  # msModelSlim's all-zero offsets: symmetric
        return dequantize_int(tensors[base + "weight"], tensors[base + "weight_scale"], off, dtype)
    shape = tuple(int(v) for v in tensors[base + "weight_shape"].tolist())
    q = unpack_int4(tensors[base + "weight_packed"], shape[-1])
    zp = tensors.get(base + "weight_zero_point")
    if zp is not None:
        zp = unpack_int4_zero_point(zp, shape[-2])
    return dequantize_int(q, tensors[base + "weight_scale"], zp, dtype)


_QUANT_SUFFIXES = ("weight_scale_inv", "weight_scale", "weight_offset", "weight_zero_point", "weight_shape",
                   "weight_packed")


def dequantize_named_params(
    named: Mapping[str, torch.Tensor], spec: SpecLike, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Inverse of `quantize_named_params` on a name -> tensor mapping.

    Quantised weights come back dequantised under their original `.weight` names; other
    floating tensors are cast to `dtype`; integer tensors pass through.
    """
    spec = as_spec(spec)
    out: dict[str, torch.Tensor] = {}
    bases: set[str] = set()
    for name, t in named.items():
        if spec.fmt == INT4_GROUP and name.endswith("weight_packed"):
            bases.add(name[: -len("weight_packed")])
        elif spec.fmt != INT4_GROUP and name.endswith(".weight") and t.dtype in (torch.int8, torch.float8_e4m3fn):
            bases.add(name[: -len("weight")])
    for base in bases:
        out[base + "weight"] = dequantize_param(base, named, spec, dtype)
    for name, t in named.items():
        suffix = name.rsplit(".", 1)[-1]
        if name in out or (suffix in _QUANT_SUFFIXES and name[: -len(suffix)] in bases):
            continue
        out[name] = t.to(dtype) if t.is_floating_point() else t
    return out

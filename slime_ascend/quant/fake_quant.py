"""QAT fake quantisation with a straight-through estimator.

Forward: dequantize(quantize(w)) with the SAME functions the exporter uses
(`quantize_fp8_block` / `quantize_int` / `quantize_mxfp8`, `dequantize_*`), so for any weight
`fake_quantize(w, spec) == dequantize_param(quantize_param(w, spec))` bit for bit.
Backward: the plain STE, d fake_quant / d w = identity everywhere (no masking of values
clipped by the range: with amax-derived scales nothing in a group is clipped except by the
half-step at the range edge, so the clipped STE would only differ on those elements).
"""

from __future__ import annotations

from typing import Any

import torch

from .fp8_block import dequantize_fp8_block, quantize_fp8_block
from .int_quant import dequantize_int, quantize_int
from .mxfp8 import dequantize_mxfp8, quantize_mxfp8
from .params import SpecLike, as_spec
from .schemes import FP8_BLOCK, MXFP8, QuantSpec


def fake_quantize_values(weight: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """dequantize(quantize(weight)) in weight.dtype, no autograd."""
    with torch.no_grad():
        w = weight.detach()
        if spec.fmt == FP8_BLOCK:
            q, s = quantize_fp8_block(w, spec.fp8)
            return dequantize_fp8_block(q, s, spec.fp8.block_size, w.dtype)
        if spec.fmt == MXFP8:
            return dequantize_mxfp8(*quantize_mxfp8(w), w.dtype)
        r = quantize_int(w, spec.int_scheme)
        return dequantize_int(r.q, r.scale, r.zero_point, w.dtype)


class FakeQuantizeSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, spec: QuantSpec) -> torch.Tensor:  # type: ignore[override]
        return fake_quantize_values(weight, spec)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad_output, None


def fake_quantize(weight: torch.Tensor, spec: SpecLike) -> torch.Tensor:
    """Differentiable fake quantisation (STE) of one weight tensor in `spec`'s format."""
    return FakeQuantizeSTE.apply(weight, as_spec(spec))

"""QAT fake quant == dequant(export) bit for bit; STE gradient is the identity."""

from __future__ import annotations

import pytest
import torch

from slime_ascend.quant import FORMATS, fake_quantize, make_spec, quantize_named_params
from slime_ascend.quant.params import dequantize_named_params

SPECS = [make_spec(f) for f in FORMATS] + [
    make_spec("int4-group", symmetric=False),
    make_spec("int4-group", numerics="torchao"),
    make_spec("int4-group", numerics="slime", symmetric=False),
    make_spec("int4-group", group_size=32, scale_dtype=torch.float32),
]
NAME = "model.layers.1.mlp.gate_proj.weight"


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.fmt}-{s.int4_numerics}-"
                         f"{getattr(s.int_scheme, 'symmetric', '')}")
@pytest.mark.parametrize("shape", [(200, 256), (3, 40, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fake_quant_equals_dequant_of_export(spec, shape, dtype):
    torch.manual_seed(0)
    w = (torch.randn(shape) * 0.02).to(dtype)
    w.view(-1, shape[-1])[0] = 0  # an all-zero row
    fq = fake_quantize(w, spec)
    exported = dict(quantize_named_params([(NAME, w)], spec))
    assert NAME in exported or NAME.replace("weight", "weight_packed") in exported
    deq = dequantize_named_params(exported, spec, dtype=dtype)[NAME]
    assert fq.dtype == dtype and fq.shape == w.shape
    assert torch.equal(fq.view(torch.uint8) if fq.element_size() == 1 else fq, deq)
    assert torch.equal(fq.float().view(torch.int32), deq.float().view(torch.int32))  # incl. signed zeros


@pytest.mark.parametrize("spec", SPECS[:4], ids=lambda s: s.fmt)
def test_ste_gradient_is_identity(spec):
    torch.manual_seed(1)
    w = torch.randn(64, 128, requires_grad=True)
    g = torch.randn(64, 128)
    out = fake_quantize(w, spec)
    assert out.requires_grad
    out.backward(g)
    assert torch.equal(w.grad, g)


def test_fake_quant_moves_values_onto_the_int8_grid():
    torch.manual_seed(2)
    w = torch.randn(16, 128)
    fq = fake_quantize(w, "int8-ct")
    assert not torch.equal(fq, w)
    assert torch.allclose(fq, w, atol=float(w.abs().max()) / 127.5)
    assert fq.unique().numel() <= 16 * 256  # at most 256 levels per row

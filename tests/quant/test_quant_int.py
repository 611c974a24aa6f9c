"""INT8 / INT4 quantisation vs compressed-tensors, vllm-ascend's W8A8 formula, torchao and slime."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import need
from slime_ascend.quant import dequantize_int, make_spec, pack_int4, quantize_int, quantize_param, unpack_int4
from slime_ascend.quant.int_quant import IntQuantized, pack_int4_zero_point, unpack_int4_zero_point
from slime_ascend.quant.params import dequantize_param

ct = need("compressed_tensors")
from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

INT8_CT = make_spec("int8-ct").int_scheme
INT8_ASCEND = make_spec("int8-w8a8").int_scheme


def ct_library(w: torch.Tensor, bits: int, group_size: int | None, symmetric: bool, scale_dtype):
    """compressed-tensors' own qparams + compressor on `w` in the working dtype of our arithmetic:
    promote(w.dtype, scale_dtype), i.e. the weight's own dtype when the scale dtype is the weight's
    (tests/quant/test_quant_ct_interop.py holds every path to the library byte for byte)."""
    strategy = "channel" if group_size is None else "group"
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size,
                            scale_dtype=scale_dtype)
    x = w.to(w.dtype if scale_dtype is None else torch.promote_types(w.dtype, scale_dtype))
    g = x.shape[-1] if group_size is None else group_size
    xg = x.reshape(*x.shape[:-1], -1, g)
    scale, zp = calculate_qparams(xg.amin(-1), xg.amax(-1), args)
    comp = IntQuantizationCompressor if bits == 8 else PackedQuantizationCompressor
    out = comp.compress({"weight": x, "weight_scale": scale, "weight_zero_point": zp},
                        QuantizationScheme(targets=["Linear"], weights=args))
    return out, scale, zp


def vllm_ascend_int8_reference(w: torch.Tensor, scale_dtype: torch.dtype):
    """vllm-ascend online W8A8 rule per row (slow loop): scale = amax/127 (rounded to the engine's
    scale dtype), q = clamp(round(w / scale), -127, 127); zero rows -> scale 0, q 0."""
    n, k = w.shape
    q = torch.zeros(n, k, dtype=torch.int8)
    s = torch.zeros(n, 1, dtype=torch.float32)
    for i in range(n):
        row = w[i].float()
        amax = row.abs().max()
        sc = (amax / 127.0).to(scale_dtype).float()
        s[i, 0] = sc
        if sc > 0:
            q[i] = torch.round(row / sc).clamp(-127, 127).to(torch.int8)
    return q, s


# ----------------------------------------------------------------------------- INT8


@pytest.mark.parametrize("shape", [(1, 64), (64, 1), (33, 300), (256, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int8_ct_equals_compressed_tensors_library(shape, dtype):
    torch.manual_seed(shape[0])
    w = (torch.randn(shape) * 0.03).to(dtype)
    w[0, 0] = 0.0
    r = quantize_int(w, INT8_CT, chunk_elems=256)
    lib, lib_scale, _ = ct_library(w, 8, None, True, dtype)
    assert r.scale.dtype == dtype and r.scale.shape == (shape[0], 1)
    assert torch.equal(r.scale, lib_scale.to(dtype))
    assert torch.equal(r.q, lib["weight"])
    assert r.q.dtype == torch.int8 and int(r.q.min()) >= -128 and int(r.q.max()) <= 127


def test_int8_ct_amax_edge_rounds_to_127_and_zero_row_eps():
    w = torch.tensor([[1.0, -1.0, 0.5], [0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    r = quantize_int(w, INT8_CT)
    # x = amax lands on ~127.5 and is clamped to 127 (never wraps to -128)
    assert int(r.q[0, 0]) == 127 and int(r.q[0, 1]) in (-128, -127)
    assert r.scale[1, 0] == torch.finfo(torch.bfloat16).eps and (r.q[1] == 0).all()
    lib, lib_scale, _ = ct_library(w, 8, None, True, torch.bfloat16)
    assert torch.equal(r.q, lib["weight"]) and torch.equal(r.scale, lib_scale.bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_ascend_equals_vllm_ascend_formula(dtype):
    torch.manual_seed(5)
    w = (torch.randn(70, 190) * 0.02).to(dtype)
    w[3] = 0
    w[4, 7] = 5.0  # one outlier row
    r = quantize_int(w, INT8_ASCEND, chunk_elems=1000)
    rq, rs = vllm_ascend_int8_reference(w, dtype)
    assert r.scale.dtype == torch.float32 and torch.equal(r.scale, rs)
    assert torch.equal(r.q, rq)
    assert r.scale[3, 0] == 0 and (r.q[3] == 0).all()
    assert int(r.q.abs().max()) <= 127


def test_int8_ascend_param_layout():
    w = torch.randn(48, 64).bfloat16()
    out = dict(quantize_param("model.layers.0.self_attn.o_proj.weight", w, "int8-w8a8"))
    p = "model.layers.0.self_attn.o_proj."
    assert set(out) == {p + "weight", p + "weight_scale", p + "weight_offset"}
    assert out[p + "weight"].dtype == torch.int8
    assert out[p + "weight_scale"].shape == (48, 1) and out[p + "weight_scale"].dtype == torch.float32
    assert torch.equal(out[p + "weight_offset"], torch.zeros(48, 1))
    # the fp32 scale holds bf16-representable values: the engine's bf16 param copy is lossless
    s = out[p + "weight_scale"]
    assert torch.equal(s.bfloat16().float(), s)


def test_int8_stacked_experts():
    torch.manual_seed(6)
    w = torch.randn(4, 40, 64).bfloat16()
    r = quantize_int(w, INT8_CT)
    assert r.q.shape == w.shape and r.scale.shape == (4, 40, 1)
    for e in range(4):
        re_ = quantize_int(w[e], INT8_CT)
        assert torch.equal(r.q[e], re_.q) and torch.equal(r.scale[e], re_.scale)


@pytest.mark.parametrize("scheme", [INT8_CT, INT8_ASCEND])
def test_int8_roundtrip_error_bound(scheme):
    torch.manual_seed(7)
    w = torch.randn(64, 256).bfloat16()
    r = quantize_int(w, scheme)
    err = (dequantize_int(r.q, r.scale) - w.float()).abs()
    s = r.scale.float()
    # half a step, plus the part of the range edge lost to clamping and bf16 scale rounding
    bound = s * 0.5 + w.float().abs().amax(-1, keepdim=True) * 2**-8
    assert (err <= bound).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("scheme", [INT8_CT, INT8_ASCEND, make_spec("int4-group").int_scheme])
def test_int_nan_inf_raise(bad, scheme):
    w = torch.randn(16, 128).bfloat16()
    w[15, 127] = bad
    with pytest.raises(ValueError, match="layers.3.mlp.up_proj.weight"):
        quantize_int(w, scheme, name="model.layers.3.mlp.up_proj.weight")


def test_int_bad_arguments():
    with pytest.raises(ValueError, match="group_size"):
        quantize_int(torch.randn(4, 100), make_spec("int4-group").int_scheme)
    with pytest.raises(TypeError):
        quantize_int(torch.zeros(4, 4, dtype=torch.int32), INT8_CT)
    with pytest.raises(ValueError):
        quantize_int(torch.zeros(4, 4), INT8_CT, out=IntQuantized(torch.empty(4, 4, dtype=torch.int8),
                                                                  torch.empty(4, 2), None))


# ----------------------------------------------------------------------------- INT4


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("shape,group", [((16, 256), 128), ((5, 96), 32), ((13, 72), 8), ((1, 128), 128)])
def test_int4_equals_compressed_tensors_library(symmetric, shape, group):
    """Layout and values identical to compressed-tensors (fp32 scales: the library on the fp32 upcast)."""
    torch.manual_seed(shape[1])
    w = (torch.randn(shape) * 0.05 + (0.0 if symmetric else 0.02)).bfloat16()
    spec = make_spec("int4-group", group_size=group, symmetric=symmetric, scale_dtype=torch.float32)
    out = dict(quantize_param("x.weight", w, spec))
    lib, lib_scale, _ = ct_library(w, 4, group, symmetric, torch.float32)
    assert torch.equal(out["x.weight_packed"], lib["weight_packed"])
    assert torch.equal(out["x.weight_scale"], lib_scale)
    assert out["x.weight_shape"].dtype == lib["weight_shape"].dtype
    assert torch.equal(out["x.weight_shape"], lib["weight_shape"])
    if symmetric:
        assert "x.weight_zero_point" not in out and "weight_zero_point" not in lib
    else:
        assert torch.equal(out["x.weight_zero_point"], lib["weight_zero_point"])
    # and the library decompresses our tensors to our dequantisation
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group)
    dec = PackedQuantizationCompressor.decompress(
        {k[2:]: v for k, v in out.items()}, QuantizationScheme(targets=["Linear"], weights=args))
    assert torch.equal(dec["weight"].float(), dequantize_param("x.", out, spec))


def test_int4_symmetric_bf16_scale_equals_library_with_scale_dtype():
    torch.manual_seed(11)
    w = (torch.randn(32, 256) * 0.05).bfloat16()
    out = dict(quantize_param("x.weight", w, "int4-group"))
    lib, lib_scale, _ = ct_library(w, 4, 128, True, torch.bfloat16)
    assert out["x.weight_scale"].dtype == torch.bfloat16
    assert torch.equal(out["x.weight_scale"], lib_scale.bfloat16())
    assert torch.equal(out["x.weight_packed"], lib["weight_packed"])


def torchao_int4_reference(w: torch.Tensor, group: int, symmetric: bool):
    """torchao formulas (specs section 4), slow per-group loop, fp32 scales, output in the signed layout."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // group)
    zps = torch.empty(n, k // group, dtype=torch.int8)
    for i in range(n):
        for j in range(k // group):
            x = w[i, j * group:(j + 1) * group].float()
            mn, mx = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
            if symmetric:
                s = torch.tensor(max(-mn, mx), dtype=torch.float32) / 7.5
                s = torch.clamp(s, min=torch.finfo(w.dtype).smallest_normal)
                zp = 0
                qq = torch.clamp(torch.round(x * (1.0 / s)) + zp, -8, 7)
            else:
                s = torch.clamp(torch.tensor(mx - mn, dtype=torch.float32) / 15, min=1e-6)
                zp = int(torch.clamp(0 - torch.round(torch.tensor(mn, dtype=torch.float32) / s), 0, 15))
                qq = torch.clamp(torch.round(x * (1.0 / s)) + zp, 0, 15) - 8  # to the signed layout
                zp -= 8
            q[i, j * group:(j + 1) * group] = qq.to(torch.int8)
            scales[i, j], zps[i, j] = s, zp
    return q, scales, zps


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_torchao_numerics(symmetric):
    torch.manual_seed(12)
    w = (torch.randn(6, 64) * 0.1 + 0.03).bfloat16()
    w[0, :32] = 0
    spec = make_spec("int4-group", group_size=32, symmetric=symmetric, numerics="torchao", scale_dtype=torch.float32)
    r = quantize_int(w, spec.int_scheme)
    q, s, z = torchao_int4_reference(w, 32, symmetric)
    assert torch.equal(r.scale, s) and torch.equal(r.q, q)
    if not symmetric:
        assert torch.equal(r.zero_point, z)


def slime_int4_reference(w: torch.Tensor, group: int, symmetric: bool, scale_dtype):
    """slime fake_int4_quant_cuda formulas (specs 3.3), per group; scale then rounded to scale_dtype."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.int8)
    for i in range(n):
        for j in range(k // group):
            x = w[i, j * group:(j + 1) * group].float()
            if symmetric:
                s = torch.clamp(x.abs().max() / 7, min=1e-5).to(scale_dtype).float()
                qq = torch.clamp(torch.round(x / s), -8, 7)
            else:
                mn, mx = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
                s = torch.clamp(torch.tensor(mx - mn) / 15, min=1e-5).to(scale_dtype).float()
                zero = torch.clamp(-torch.round(torch.tensor(mn) / s), 0, 15)
                qq = torch.clamp(torch.round(x / s) + zero, 0, 15) - 8
            q[i, j * group:(j + 1) * group] = qq.to(torch.int8)
    return q


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_slime_numerics(symmetric):
    torch.manual_seed(13)
    w = (torch.randn(5, 256) * 0.05).bfloat16()
    spec = make_spec("int4-group", group_size=128, symmetric=symmetric, numerics="slime")
    r = quantize_int(w, spec.int_scheme)
    assert torch.equal(r.q, slime_int4_reference(w, 128, symmetric, torch.bfloat16))
    if symmetric:
        assert int(r.q.min()) >= -7  # amax/7: the -8 code is never used


@pytest.mark.parametrize("numerics", ["compressed-tensors", "torchao", "slime"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_roundtrip_error_bound(numerics, symmetric):
    torch.manual_seed(14)
    w = torch.randn(32, 256).bfloat16()
    r = quantize_int(w, make_spec("int4-group", symmetric=symmetric, numerics=numerics).int_scheme)
    deq = dequantize_int(r.q, r.scale, r.zero_point)
    s = r.scale.float().repeat_interleave(128, -1)
    err = (deq - w.float()).abs()
    # half a step; the range edge (amax/7.5 -> 7.5 clamped to 7) and the bf16-rounded scale
    # (relative error <= 2^-9 over <= 8 steps) add at most 8 * 2^-8 steps; asymmetric adds the
    # zero-point rounding (half a step)
    assert (err <= s * ((0.5 if symmetric else 1.0) + 8 * 2**-8)).all()


def test_int4_all_zero_groups_and_3d():
    w = torch.zeros(2, 8, 256, dtype=torch.bfloat16)
    w[1, 3, 5] = 1.0
    for sym in (True, False):
        out = dict(quantize_param("e.weight", w, make_spec("int4-group", symmetric=sym)))
        assert out["e.weight_packed"].shape == (2, 8, 32)
        assert out["e.weight_scale"].shape == (2, 8, 2)
        assert out["e.weight_shape"].tolist() == [2, 8, 256]
        if not sym:
            assert out["e.weight_zero_point"].shape == (2, 1, 2)
        deq = dequantize_param("e.", out, make_spec("int4-group", symmetric=sym))
        assert torch.isfinite(deq).all()
        assert (deq[0] == 0).all() and deq[1, 3, 5] == pytest.approx(1.0, rel=0.1)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), words=st.integers(1, 6), extra=st.integers(0, 7), seed=st.integers(0, 2**16))
def test_pack_int4_matches_library(rows, words, extra, seed):
    g = torch.Generator().manual_seed(seed)
    c = words * 8 - extra
    v = torch.randint(-8, 8, (rows, c), dtype=torch.int8, generator=g)
    assert torch.equal(pack_int4(v), pack_to_int32(v, 4))
    assert torch.equal(unpack_int4(pack_int4(v), c), v)
    assert torch.equal(pack_int4_zero_point(v), pack_to_int32(v, 4, packed_dim=0))
    assert torch.equal(unpack_int4_zero_point(pack_int4_zero_point(v), rows), v)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 24), groups=st.integers(1, 4), sym=st.booleans(),
       mag=st.sampled_from([1e-4, 1e-2, 1.0, 100.0]), seed=st.integers(0, 2**16))
def test_property_int4_ct_values(n, groups, sym, mag, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, 32 * groups, generator=g) * mag).bfloat16()
    spec = make_spec("int4-group", group_size=32, symmetric=sym, scale_dtype=torch.float32)
    out = dict(quantize_param("x.weight", w, spec))
    lib, lib_scale, _ = ct_library(w, 4, 32, sym, torch.float32)
    assert torch.equal(out["x.weight_packed"], lib["weight_packed"])
    assert torch.equal(out["x.weight_scale"], lib_scale)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 24), k=st.integers(1, 300), mag=st.sampled_from([1e-5, 1e-2, 1.0, 1e4]),
       seed=st.integers(0, 2**16))
def test_property_int8_ct_values(n, k, mag, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * mag).bfloat16()
    r = quantize_int(w, INT8_CT, chunk_elems=97)
    lib, lib_scale, _ = ct_library(w, 8, None, True, torch.bfloat16)
    assert torch.equal(r.q, lib["weight"]) and torch.equal(r.scale, lib_scale.bfloat16())

"""MXFP8 (OCP MX v1.0, e4m3 + E8M0 per 32) against a slow reference in exact rational arithmetic."""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend.quant.mxfp8 import dequantize_mxfp8, e8m0_to_float, quantize_mxfp8

FP8 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------- reference
def _e4m3_table() -> list[tuple[Fraction, int]]:
    """Every finite non-negative e4m3fn value with its code (0x7F is NaN): E=0 subnormals M/8 * 2^-6,
    else (1 + M/8) * 2^(E-7)."""
    out = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        v = Fraction(m, 8) * Fraction(2) ** -6 if e == 0 else (1 + Fraction(m, 8)) * Fraction(2) ** (e - 7)
        out.append((v, code))
    return out


E4M3 = _e4m3_table()
assert E4M3[-1][0] == 448


def _round_e4m3(v: Fraction, negative: bool) -> int:
    """Nearest e4m3fn code to |v| <= 448, ties to the even code (even mantissa), sign bit from `negative`."""
    a = abs(v)
    best = min(E4M3, key=lambda t: (abs(t[0] - a), t[1] & 1))
    return best[1] | (0x80 if negative else 0)


def mxfp8_reference(values: list[float]) -> tuple[list[int], int]:
    """One block of 32 Python floats (each an fp32 value) -> (element codes, scale byte), by the OCP rule
    in exact arithmetic: shared = floor(log2(amax)) - 8 clamped to [-127, 127]; all-zero -> -127;
    q = RNE(clamp(x / 2^shared, +-448))."""
    assert len(values) == 32
    amax = max(abs(Fraction(x)) for x in values)
    if amax == 0:
        shared = -127
    else:
        e = 0
        while Fraction(2) ** (e + 1) <= amax:
            e += 1
        while Fraction(2) ** e > amax:
            e -= 1
        shared = max(-127, min(127, e - 8))
    scale = Fraction(2) ** shared
    codes = []
    for x in values:
        v = Fraction(x) / scale
        v = max(Fraction(-448), min(Fraction(448), v))
        codes.append(_round_e4m3(v, math.copysign(1.0, x) < 0))
    return codes, shared + 127


def reference_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = w.float().reshape(-1, 32).tolist()
    codes, scales = zip(*(mxfp8_reference(row) for row in flat))
    q = torch.tensor(codes, dtype=torch.uint8).reshape(w.shape)
    s = torch.tensor(scales, dtype=torch.uint8).reshape(*w.shape[:-1], w.shape[-1] // 32)
    return q, s


def _assert_matches_reference(w: torch.Tensor, chunk_elems: int | None = None) -> None:
    kw = {} if chunk_elems is None else {"chunk_elems": chunk_elems}
    q, s = quantize_mxfp8(w, **kw)
    rq, rs = reference_tensor(w)
    assert q.dtype == FP8 and s.dtype == torch.uint8
    assert torch.equal(s, rs), (s, rs)
    assert torch.equal(q.view(torch.uint8), rq), (q.view(torch.uint8), rq)


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


# ------------------------------------------------------------------------------------------- properties
finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
any_bits_f32 = st.integers(0, 0xFFFFFFFF).map(_f32).filter(math.isfinite)  # subnormals as often as normals


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(finite_f32, any_bits_f32, st.sampled_from([0.0, -0.0, 448.0, 2.0 ** -149])),
                min_size=64, max_size=64))
def test_random_fp32_blocks_match_reference(vals):
    _assert_matches_reference(torch.tensor(vals, dtype=torch.float32).view(2, 32))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, width=32), min_size=96, max_size=96), st.sampled_from([torch.bfloat16,
                                                                                            torch.float16]))
def test_bf16_fp16_blocks_match_reference(vals, dtype):
    _assert_matches_reference(torch.tensor(vals).to(dtype).view(1, 96))


@settings(max_examples=60, deadline=None)
@given(st.integers(-127, 119), st.lists(st.integers(0, 0x7D), min_size=31, max_size=31),
       st.lists(st.booleans(), min_size=32, max_size=32), st.integers(256, 511))
def test_ties_between_e4m3_values_round_to_even(shared, codes, signs, top):
    """Elements exactly halfway between two adjacent e4m3 values (times the block's scale), plus one
    element that fixes amax in [2^(shared+8), 2^(shared+9)): each tie goes to the even code."""
    scale = 2.0 ** shared
    vals = [float(top) * scale]  # amax / scale in [256, 512): floor(log2) = shared + 8
    for c in codes:
        mid = (E4M3[c][0] + E4M3[c + 1][0]) / 2
        vals.append(float(mid) * scale)
    vals = [-v if neg else v for v, neg in zip(vals, signs)]
    assert all(_f32(struct.unpack("<I", struct.pack("<f", v))[0]) == v for v in vals)  # exact in fp32
    w = torch.tensor(vals, dtype=torch.float32).view(1, 32)
    _assert_matches_reference(w)
    q, s = quantize_mxfp8(w)
    assert int(s[0, 0]) == max(shared, -127) + 127


@pytest.mark.parametrize("e", [-149, -127, -126, -119, -118, -1, 0, 1, 8, 9, 100, 127])
def test_amax_at_powers_of_two(e):
    """amax exactly 2^e: shared = e - 8 (clamped to -127), so amax quantises to 256 (or more at the clamp)."""
    vals = [0.0] * 32
    vals[5] = 2.0 ** e
    vals[6] = -(2.0 ** e) / 3
    w = torch.tensor(vals, dtype=torch.float32).view(1, 32)
    _assert_matches_reference(w)
    _, s = quantize_mxfp8(w)
    assert int(s[0, 0]) == max(e - 8, -127) + 127


def test_zero_block_scale_and_signed_zero():
    w = torch.zeros(2, 64)
    w[1, 3] = -0.0
    w[1, 40] = 3.0
    q, s = quantize_mxfp8(w)
    assert int(s[0, 0]) == 0 and int(s[0, 1]) == 0 and int(s[1, 0]) == 0  # all-zero blocks: 2^-127
    assert int(s[1, 1]) == 1 - 8 + 127  # amax 3 -> floor(log2) 1
    assert int(q.view(torch.uint8)[1, 3]) == 0x80  # -0 keeps its sign
    _assert_matches_reference(w)


def test_saturates_above_448():
    """amax / scale lies in [256, 512): 480..511 saturate to 448 (the torch cast alone would give NaN)."""
    w = torch.full((1, 32), 1.0)
    w[0, 0] = 511 / 256  # amax 1.996 -> shared -8, amax / scale = 511
    q, s = quantize_mxfp8(w)
    assert float(q[0, 0].float()) == 448.0 and int(s[0, 0]) == 127 - 8
    _assert_matches_reference(w)


def test_experts_and_chunking_match_reference():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(3, 5, 96, generator=g) * torch.logspace(-30, 10, 96)).to(torch.bfloat16)
    _assert_matches_reference(w)
    _assert_matches_reference(w, chunk_elems=96)  # one row per chunk
    a = quantize_mxfp8(w)
    b = quantize_mxfp8(w, chunk_elems=200)
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def test_out_buffers_reused():
    w = torch.randn(4, 64, dtype=torch.bfloat16)
    out = (torch.empty(4, 64, dtype=FP8), torch.empty(4, 2, dtype=torch.uint8))
    q, s = quantize_mxfp8(w, out=out)
    assert q is out[0] and s is out[1]
    with pytest.raises(ValueError, match="out\\[1\\]"):
        quantize_mxfp8(w, out=(out[0], torch.empty(4, 3, dtype=torch.uint8)))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_refused(bad):
    w = torch.ones(2, 32)
    w[1, 7] = bad
    with pytest.raises(ValueError, match="w: weight contains NaN or inf"):
        quantize_mxfp8(w, name="w")


def test_k_not_multiple_of_32_refused():
    with pytest.raises(ValueError, match="last dimension 48 .* not a multiple of 32.*Fix: keep this tensor"):
        quantize_mxfp8(torch.ones(2, 48), name="x.weight")


def test_dequantize_is_exact_and_scale_is_e8m0():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 128, generator=g, dtype=torch.float32)
    q, s = quantize_mxfp8(w)
    assert torch.equal(e8m0_to_float(s), s.view(torch.float8_e8m0fnu).float())
    d = dequantize_mxfp8(q, s)
    ref = q.float().view(8, 4, 32) * torch.tensor([[2.0 ** (b - 127) for b in row] for row in s.tolist()])[..., None]
    assert torch.equal(d, ref.view(8, 128))
    # e4m3 keeps 3 mantissa bits: error <= 2^-4 |w| for normals, <= 2^-10 * scale in the subnormal range,
    # after OCP's saturation of |w| / scale to 448 (amax / scale lies in [256, 512))
    scale = e8m0_to_float(s).repeat_interleave(32, dim=-1)
    sat = torch.maximum(torch.minimum(w, 448 * scale), -448 * scale)
    assert bool(((d - sat).abs() <= torch.maximum(sat.abs() * 2.0 ** -4, scale * 2.0 ** -10)).all())
    assert bool((sat != w).any())  # randn blocks do hit the saturation

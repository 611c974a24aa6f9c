"""FP8 block quantisation vs the DeepSeek block formula written as a slow loop."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_ascend.quant import FP8BlockScheme, dequantize_fp8_block, quantize_fp8_block

sys.path.insert(0, str(Path(__file__).parent))
from _quant_refs import fp8_block_reference  # noqa: E402

FP8 = torch.float8_e4m3fn


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("shape", [(256, 256), (1, 300), (300, 1), (130, 257), (128, 128), (7, 129), (513, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_matches_deepseek_reference_bit_for_bit(shape, dtype):
    torch.manual_seed(sum(shape))
    w = (torch.randn(shape) * 0.05).to(dtype)
    q, s = quantize_fp8_block(w, chunk_elems=1 << 12)  # small chunks: several chunks and a tail block
    rq, rs = fp8_block_reference(w)
    assert q.dtype == FP8 and s.dtype == torch.float32
    assert s.shape == rs.shape
    assert torch.equal(s, rs)
    assert torch.equal(bits(q), bits(rq))


@pytest.mark.parametrize("block", [(64, 32), (1, 128), (128, 1), (3, 5)])
def test_other_block_sizes(block):
    torch.manual_seed(1)
    w = torch.randn(70, 90).bfloat16()
    q, s = quantize_fp8_block(w, FP8BlockScheme(block), chunk_elems=1 << 10)
    rq, rs = fp8_block_reference(w, *block)
    assert torch.equal(s, rs) and torch.equal(bits(q), bits(rq))


def test_chunking_does_not_change_results():
    torch.manual_seed(2)
    w = torch.randn(700, 300).bfloat16()
    a = quantize_fp8_block(w, chunk_elems=1 << 30)
    b = quantize_fp8_block(w, chunk_elems=1)
    assert torch.equal(a[1], b[1]) and torch.equal(bits(a[0]), bits(b[0]))


def test_stacked_experts_3d_equal_per_expert():
    torch.manual_seed(3)
    w = torch.randn(3, 200, 136).bfloat16()
    q, s = quantize_fp8_block(w)
    assert q.shape == w.shape and s.shape == (3, 2, 2)
    for e in range(3):
        qe, se = quantize_fp8_block(w[e])
        assert torch.equal(s[e], se) and torch.equal(bits(q[e]), bits(qe))


def test_non_contiguous_input():
    torch.manual_seed(4)
    w = torch.randn(300, 200).bfloat16()
    q, s = quantize_fp8_block(w.t())
    rq, rs = fp8_block_reference(w.t().contiguous())
    assert torch.equal(s, rs) and torch.equal(bits(q), bits(rq))


def test_all_zero_blocks_positive_scale_and_zero_values():
    # slime tests/test_block_fp8_zero_block.py cases, re-expressed for our quantiser
    w = torch.zeros(256, 256, dtype=torch.bfloat16)
    w[0, 0] = 1.0
    q, s = quantize_fp8_block(w)
    assert not torch.isnan(q.float()).any() and not torch.isinf(q.float()).any()
    assert (s > 0).all()
    assert s[0, 0] == torch.tensor(1.0) / 448 and torch.all(s.flatten()[1:] == torch.tensor(1e-12) / 448)
    z = torch.zeros(128, 128, dtype=torch.bfloat16)
    qz, sz = quantize_fp8_block(z)
    assert (dequantize_fp8_block(qz, sz) == 0).all()


def test_nonzero_blocks_roundtrip_error_bound():
    torch.manual_seed(0)
    w = torch.randn(256, 256).bfloat16()
    q, s = quantize_fp8_block(w)
    err = (dequantize_fp8_block(q, s) - w.float()).abs()
    # e4m3: relative half-ulp 2^-4 at normal values; absolute floor = half the smallest subnormal step
    sb = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    bound = torch.maximum(w.float().abs() * 2**-4, sb * 2**-10)
    assert (err <= bound * (1 + 1e-6)).all()
    assert err.max() < 0.5


def test_extremes_saturate_not_nan():
    w = torch.tensor([[3.0e38, -3.0e38, 1.0, -1e-30]], dtype=torch.float32)
    q, s = quantize_fp8_block(w)
    assert torch.isfinite(q.float()).all()
    assert q.float()[0, 0] == 448 and q.float()[0, 1] == -448
    assert torch.isfinite(s).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_inf_raise_naming_tensor(bad):
    w = torch.randn(300, 300).bfloat16()
    w[299, 1] = bad
    with pytest.raises(ValueError, match="my.layer.weight"):
        quantize_fp8_block(w, name="my.layer.weight")


def test_bad_arguments():
    with pytest.raises(TypeError):
        quantize_fp8_block(torch.zeros(4, 4, dtype=torch.int8))
    with pytest.raises(ValueError):
        quantize_fp8_block(torch.zeros(4))
    with pytest.raises(ValueError):
        FP8BlockScheme((0, 128))
    q, s = quantize_fp8_block(torch.randn(4, 4))
    with pytest.raises(ValueError, match="scale_inv shape"):
        dequantize_fp8_block(q, s, (2, 2))


def test_out_buffers_are_used():
    w = torch.randn(130, 260).bfloat16()
    q0 = torch.empty(130, 260, dtype=FP8)
    s0 = torch.empty(2, 3)
    q, s = quantize_fp8_block(w, out=(q0, s0))
    assert q is q0 and s is s0
    ref = quantize_fp8_block(w)
    assert torch.equal(bits(q), bits(ref[0])) and torch.equal(s, ref[1])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 200), k=st.integers(1, 200), scale=st.sampled_from([1e-6, 1e-2, 1.0, 1e3]),
       seed=st.integers(0, 2**16))
def test_property_matches_reference(n, k, scale, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * scale).bfloat16()
    q, s = quantize_fp8_block(w, FP8BlockScheme((64, 64)), chunk_elems=1 << 11)
    rq, rs = fp8_block_reference(w, 64, 64)
    assert torch.equal(s, rs) and torch.equal(bits(q), bits(rq))


@pytest.mark.slime
def test_identical_to_slime_offline_converter_block_fp8():
    """slime's tools/convert_hf_to_fp8.py block_fp8 gives the same bits on blocks with amax >= 1e-12."""
    import importlib.util
    from pathlib import Path

    import slime

    path = Path(next(iter(slime.__path__))).parent / "tools" / "convert_hf_to_fp8.py"
    assert path.is_file(), f"{path} is not in this slime tree (slime's offline FP8 converter moved?)"
    spec = importlib.util.spec_from_file_location("slime_convert_hf_to_fp8", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    for shape in [(256, 256), (130, 300), (1, 128)]:
        w = torch.randn(shape).bfloat16()
        rq, rs = mod.block_fp8(w, (128, 128))
        q, s = quantize_fp8_block(w)
        assert torch.equal(s, rs) and torch.equal(bits(q), bits(rq))
    # all-zero blocks: both give finite, positive scales and exact-zero values
    z = torch.zeros(256, 256, dtype=torch.bfloat16)
    rq, rs = mod.block_fp8(z, (128, 128))
    q, s = quantize_fp8_block(z)
    assert (rs > 0).all() and (s > 0).all() and (q.float() == 0).all() and (rq.float() == 0).all()

"""The native CPU kernels (`quant/native.py`) against plain torch references, element type by
element type, and their build: cached, keyed, and a clear fallback without a compiler."""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from slime_ascend.quant import fused as F
from slime_ascend.quant import native as N
from slime_ascend.quant.fp8_block import quantize_fp8_block
from slime_ascend.quant.int_quant import quantize_int
from slime_ascend.quant.schemes import INT8_ASCEND_SCHEME, INT8_CT_SCHEME

sys.path.insert(0, str(Path(__file__).parent))
from _quant_refs import expand_blocks, fp8_block_reference  # noqa: E402

FP8 = torch.float8_e4m3fn
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HAVE_CC = shutil.which("cc") is not None or shutil.which("gcc") is not None

pytestmark = pytest.mark.skipif(not N.available() and not HAVE_CC,
                                reason=f"no C compiler: native kernels unavailable ({N.unavailable_reason()})")


def test_kernels_build_here():
    """With a C compiler present the kernels must build: a silent fallback would hide a regression."""
    assert N.available(), N.unavailable_reason()


def _weight(dtype, rows=150, cols=517, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 3
    w[0, 3] = -0.0
    w[5] = 0.0
    w[7, :40] = torch.finfo(dtype).tiny * torch.rand(40, generator=g)  # subnormal-ish magnitudes
    w[9, 11] = -torch.finfo(dtype).max if dtype != torch.float32 else -1e30
    return w.to(dtype)


def _fp8(w, bn, bk, fmax=448.0, floor=1e-12):
    q = torch.empty(w.shape, dtype=FP8)
    s = torch.empty(-(-w.shape[0] // bn), -(-w.shape[1] // bk))
    N.fp8_block_quantize(w, bn, bk, floor, fmax, q, s)
    return q, s


@pytest.mark.parametrize("dtype", DTYPES)
def test_group_absmax(dtype):
    w = _weight(dtype)
    x = w.float()
    got = N.group_absmax(w, 64)
    ref = torch.stack([x[:, i:i + 64].abs().amax(1) for i in range(0, x.shape[1], 64)], 1)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocks", [(32, 100), (128, 128), (7, 517), (1000, 1)])
@pytest.mark.parametrize("fmax", [448.0, 240.0])  # 448: the clamp-free loop; otherwise clamped
def test_fp8_block_kernel(dtype, blocks, fmax):
    w = _weight(dtype)
    q, s = _fp8(w, *blocks, fmax=fmax)
    rq, rs = fp8_block_reference(w, *blocks, fmax=fmax)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_weight_gives_non_finite_maxima_and_scales(dtype, bad):
    w = _weight(dtype)
    w[3, 100] = bad
    assert not torch.isfinite(N.group_absmax(w, 64)[3, 1])
    _, s = _fp8(w, 2, 128)
    assert not torch.isfinite(s[1, 0]) and torch.isfinite(s[0, 0]) and torch.isfinite(s[1, 1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16_bit_value_reads_exactly(dtype):
    """All 65536 bit patterns: |x| through the |max| kernel (one-element groups) is torch's, NaN for
    NaN; the sign survives into the fp8 code (one-element blocks)."""
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype).view(256, 256)
    got, ref = N.group_absmax(x, 1), x.float().abs()
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.equal(got[~torch.isnan(ref)], ref[~torch.isnan(ref)])
    finite = x.clone()
    finite[~torch.isfinite(x)] = 0
    q, _ = _fp8(finite, 1, 1)
    assert torch.equal(q.view(torch.uint8) >= 0x80, torch.signbit(finite.float()))


def _sweep(values: torch.Tensor, width: int = 1023) -> None:
    """fp8 of `values` (|v| <= 448) with scale exactly 1: each row carries an extra 448 so every
    (64 x width+1) block's max is 448; the result must be torch's cast."""
    n = values.numel()
    rows = -(-n // width)
    x = torch.zeros(rows * width)
    x[:n] = values
    x = torch.cat([x.view(rows, width), torch.full((rows, 1), 448.0)], 1)
    q, s = _fp8(x, 64, width + 1)
    assert torch.equal(s, torch.ones_like(s))
    got = q[:, :width].reshape(-1)[:n].view(torch.uint8)
    assert torch.equal(got, values.to(FP8).view(torch.uint8))


def test_e4m3_rounding_matches_torch_across_the_range():
    """Every 97th fp32 bit pattern in [-448, 448] (23 million values, all binades, subnormals of e4m3
    and fp32 included), every e4m3 midpoint and its neighbours: the kernel's cast is torch's."""
    bits = torch.arange(0, 0x43E00001, 97, dtype=torch.int64).to(torch.int32)
    allv = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    allv = allv[torch.isfinite(allv)].unique()
    mids = (allv[1:] + allv[:-1]) / 2
    near = torch.cat([(mids.view(torch.int32) + d).view(torch.float32) for d in (-1, 0, 1)])
    v = torch.cat([bits.view(torch.float32), near[near.abs() <= 448], torch.tensor([448.0, 0.0])])
    _sweep(torch.cat([v, -v]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reciprocal", [False, True])
@pytest.mark.parametrize("quotient", [None, torch.bfloat16, torch.float16])
def test_int_kernel(dtype, reciprocal, quotient):
    w = _weight(dtype)
    d = (N.group_absmax(w, 32) / 7.0).to(torch.bfloat16).float()
    d[d == 0] = 1.0
    div = torch.reciprocal(d) if reciprocal else d
    q = torch.empty(w.shape, dtype=torch.int8)
    N.int_quantize(w, div, 32, -8, 7, reciprocal, q, quotient_dtype=quotient)
    full = expand_blocks(div, *w.shape, 1, 32)
    y = w.float() * full if reciprocal else w.float() / full
    ref = (y if quotient is None else y.to(quotient).float()).round().clamp(-8, 7).to(torch.int8)
    assert torch.equal(q, ref)


@pytest.mark.parametrize("quotient", [torch.bfloat16, torch.float16])
def test_int_kernel_quotient_rounding_is_torchs_cast(quotient):
    """Quotients (scale 1) over every binade up to the int8 range, every 251st fp32 bit pattern, and each
    bf16 / fp16 midpoint with its fp32 neighbours: rounded to the dtype, then to an int8 code, as torch's
    cast and round give them."""
    top = int(torch.tensor(130.0).view(torch.int32))
    pats = torch.arange(0, top, 251, dtype=torch.int64).to(torch.int32).view(torch.float32)
    grid = torch.arange(1 << 15, dtype=torch.int32).to(torch.int16).view(quotient).float()
    grid = grid[torch.isfinite(grid) & (grid <= 130)].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # exact in fp32
    near = torch.cat([(mids.view(torch.int32) + k).view(torch.float32) for k in (-1, 0, 1)])
    y = torch.cat([pats, near, grid])
    y = torch.cat([y, -y]).reshape(-1, 1)
    q = torch.empty(y.shape, dtype=torch.int8)
    N.int_quantize(y, torch.ones(y.shape[0], 1), 1, -128, 127, False, q, quotient_dtype=quotient)
    assert torch.equal(q, y.to(quotient).float().round().clamp(-128, 127).to(torch.int8))


def test_int_kernel_rounds_ties_to_even_and_clamps():
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, -128.5, -129.5, 1e30, -1e30, -0.0]])
    q = torch.empty(x.shape, dtype=torch.int8)
    N.int_quantize(x, torch.ones(1, 1), x.shape[1], -128, 127, False, q)
    assert q.tolist() == [[0, 2, 2, 0, -2, -2, 126, 127, -128, -128, 127, -128, 0]]


def test_strided_rows_and_outputs():
    base = _weight(torch.bfloat16, 64, 600)
    w = base[:, 50:450]  # row stride 600, last dim contiguous
    q_ref, s_ref = _fp8(w.contiguous(), 16, 128)
    big_q = torch.zeros(64, 500, dtype=FP8)
    big_s = torch.zeros(4, 9)
    N.fp8_block_quantize(w, 16, 128, 1e-12, 448.0, big_q[:, 100:], big_s[:, 5:])
    assert torch.equal(big_q[:, 100:].view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(big_s[:, 5:], s_ref)
    assert not big_q[:, :100].view(torch.uint8).any() and not big_s[:, :5].any()  # nothing written outside


def test_bad_arguments_are_clear_errors():
    w = _weight(torch.bfloat16, 16, 64)[:8]
    q = torch.empty(w.shape, dtype=FP8)
    with pytest.raises(ValueError, match="contiguous last dim"):
        N.group_absmax(w.t(), 8)
    with pytest.raises(ValueError, match="fmax"):
        N.fp8_block_quantize(w, 8, 64, 1e-12, 500.0, q, torch.empty(1, 1))
    with pytest.raises(ValueError, match="scale"):
        N.fp8_block_quantize(w, 8, 64, 1e-12, 448.0, q, torch.empty(2, 2))
    with pytest.raises(ValueError, match="int8"):
        N.int_quantize(w, torch.ones(8, 1), 64, -200, 127, False, torch.empty(w.shape, dtype=torch.int8))
    with pytest.raises(ValueError, match="float64"):
        N.group_absmax(w.double(), 8)


def test_stacked_experts_and_default_path_equal_eager():
    w = torch.randn(3, 130, 300, dtype=torch.bfloat16)
    F.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for scheme in (INT8_ASCEND_SCHEME, INT8_CT_SCHEME):
            a, b = quantize_int(w, scheme, fused=False), quantize_int(w, scheme)  # default: auto -> native
            assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale)
        a, b = quantize_fp8_block(w, fused=False), quantize_fp8_block(w)
        assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])
    assert F.verdict(("int", "native", INT8_ASCEND_SCHEME, w.dtype, "cpu")) is True  # the native kernels ran


def test_build_is_cached_and_keyed(tmp_path, monkeypatch):
    monkeypatch.setenv(N.CACHE_ENV, str(tmp_path))
    first = N._build(N._compiler())
    assert first.parent == tmp_path / "native" and first.exists()
    record = first.with_name(first.name + ".sha256")  # checked before every load
    assert record.read_text().strip() == hashlib.sha256(first.read_bytes()).hexdigest()
    assert not first.stat().st_mode & 0o022 and not record.stat().st_mode & 0o022
    assert N._build(N._compiler()) == first  # found in the cache, not rebuilt
    mtime = first.stat().st_mtime_ns
    assert N._build(N._compiler()).stat().st_mtime_ns == mtime
    monkeypatch.setattr(N, "_BASE_FLAGS", N._BASE_FLAGS + ["-DSA_UNUSED_FLAG"])
    assert N._build(N._compiler()) != first  # other flags, other key


def test_no_compiler_means_eager_with_a_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv(N.CACHE_ENV, str(tmp_path))
    N._reset_for_tests()
    F.reset()
    try:
        assert not N.available()
        assert "no C compiler" in N.unavailable_reason()
        w = torch.randn(4, 256, dtype=torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # auto: quietly eager
            got = quantize_int(w, INT8_ASCEND_SCHEME)
        with pytest.warns(RuntimeWarning, match="native kernels unavailable.*no C compiler"):
            quantize_fp8_block(w, fused="native")  # asked for explicitly: one warning
        assert torch.equal(got.q, quantize_int(w, INT8_ASCEND_SCHEME, fused=False).q)
        with pytest.raises(RuntimeError, match="unavailable"):
            N.group_absmax(w, 8)
    finally:
        monkeypatch.undo()
        N._reset_for_tests()
        F.reset()
    assert N.available()  # found again with the real compiler


@pytest.mark.slow
def test_e4m3_rounding_matches_torch_on_every_fp32_value_in_range():
    """All 2,277,507,074 fp32 values with |y| <= 448 (about 30 s on 2 cores): the kernel's integer
    rounding is torch's float8_e4m3fn cast, bit for bit."""
    chunk, top = 1 << 24, 0x43E00000 + 1
    for start in range(0, top, chunk):
        v = torch.arange(start, min(start + chunk, top), dtype=torch.int64).to(torch.int32).view(torch.float32)
        _sweep(v)
        _sweep(-v)


def test_unusable_cache_falls_back_to_a_temporary_directory(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv(N.CACHE_ENV, str(blocker))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.warns(RuntimeWarning, match=rf"cache {blocker}/native not used: .*cannot be created.*{N.CACHE_ENV}"):
        built = N._build(N._compiler())
    assert built.exists() and blocker not in built.parents and blocker.read_text().startswith("a file")

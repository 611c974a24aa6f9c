"""`int8-ct` and `int4-group` bytes equal the compressed-tensors library's own quantisation of the
weight in its own dtype (issue 17, item 6).

The library's path, as llm-compressor drives it for a bf16/fp16 model: the weight's min/max per
channel or group in the weight's dtype (the memoryless min-max observer: `torch.amin` / `torch.amax`),
`calculate_qparams` on them (every step in that dtype), then the compressor's `compress` (its
`quantize`: x / scale in that dtype, + zero point, clamp, round) and `pack_to_int32`. Every
quantisation path of ours (eager, the native kernels, the default choice) must give the same bytes:
packed weights, scales and zero points.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import need
from slime_ascend.quant import fused as F
from slime_ascend.quant import make_spec, quantize_param
from slime_ascend.quant import native as N
from slime_ascend.quant.int_quant import quantize_int

ct = need("compressed_tensors")
from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16]
NAME = "model.layers.0.mlp.down_proj.weight"
BASE = NAME[: -len("weight")]
# eager, the native C kernels (where they build) and the default choice (`auto`)
PATHS = [False, "native", None] if N.available() else [False, None]


def library(w: torch.Tensor, bits: int, group: int | None, symmetric: bool, scale_dtype=None) -> dict:
    """The library's own tensors for one [N, K] weight, computed in the weight's dtype."""
    strategy = "channel" if group is None else "group"
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group,
                            scale_dtype=scale_dtype)
    g = w.shape[-1] if group is None else group
    wg = w.unflatten(-1, (w.shape[-1] // g, g))
    scale, zp = calculate_qparams(torch.amin(wg, dim=-1), torch.amax(wg, dim=-1), args)
    state = {"weight": w, "weight_scale": scale}
    if not symmetric:
        state["weight_zero_point"] = zp
    comp = IntQuantizationCompressor if bits == 8 else PackedQuantizationCompressor
    return comp.compress(state, QuantizationScheme(targets=["Linear"], weights=args))


def library_stacked(w: torch.Tensor, *a, **k) -> dict:
    """The library per expert of a stacked [E, N, K] weight (it quantises 2-D Linear weights)."""
    if w.dim() == 2:
        return library(w, *a, **k)
    per = [library(e, *a, **k) for e in w]
    out = {name: torch.stack([p[name] for p in per]) for name in per[0] if name != "weight_shape"}
    if "weight_shape" in per[0]:
        out["weight_shape"] = torch.tensor(tuple(w.shape))
    return out


def ours(w: torch.Tensor, spec, fused) -> dict:
    """Our tensors for the same weight through the params funnel (which takes the kernel choice from
    the environment), named as the library names them."""
    before = os.environ.get(F.ENV_VAR)
    os.environ[F.ENV_VAR] = {False: "off", "native": "native", None: "auto"}[fused]
    try:
        return {k[len(BASE):]: v for k, v in quantize_param(NAME, w, spec)}
    finally:
        if before is None:
            os.environ.pop(F.ENV_VAR)
        else:
            os.environ[F.ENV_VAR] = before


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as integers of the same width (tells -0.0 from 0.0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_bytes(mine: dict, lib: dict, dtype: torch.dtype) -> None:
    assert set(mine) == set(lib), (sorted(mine), sorted(lib))
    for name, t in lib.items():
        got = mine[name]
        if name == "weight_scale":  # ours is stored in the scale dtype; the library keeps the weight's
            assert got.dtype == dtype
            t = t.to(dtype)
            assert torch.equal(t.float(), lib[name].float()), "the library's scale is not representable"
        assert got.dtype == t.dtype and got.shape == t.shape, (name, got.dtype, t.dtype, got.shape, t.shape)
        same = _bits(got) == _bits(t)
        assert bool(same.all()), f"{name}: {int((~same).sum())} of {same.numel()} values differ in their bits"


def check(w: torch.Tensor, fmt: str, *, group: int | None = None, symmetric: bool = True, scale_dtype=None,
          paths=None) -> None:
    bits = 8 if fmt == "int8-ct" else 4
    lib_scale_dtype = scale_dtype
    spec_kw = {} if fmt == "int8-ct" else {"group_size": group, "symmetric": symmetric}
    spec = make_spec(fmt, scale_dtype=scale_dtype, **spec_kw)
    work = w.dtype if scale_dtype is None else torch.promote_types(w.dtype, scale_dtype)
    lib = library_stacked(w.to(work), bits, None if fmt == "int8-ct" else group, symmetric, lib_scale_dtype)
    for fused in (PATHS if paths is None else paths):
        F.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a fast path disabled by its self-check fails
            assert_same_bytes(ours(w, spec, fused), lib, scale_dtype or w.dtype)


def weight(shape, dtype, seed=0, scale=0.02, shift=0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + shift).to(dtype)


# ------------------------------------------------------------------------------------------- INT8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (64, 1), (37, 300), (256, 512)])
def test_int8_ct_bytes_equal_library(dtype, shape):
    check(weight(shape, dtype, seed=shape[0]), "int8-ct")


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_ct_edge_rows_equal_library(dtype):
    info = torch.finfo(dtype)
    w = weight((12, 256), torch.float32, seed=3)
    w[0] = 0.0  # all-zero row: scale eps
    w[1] = -0.0
    w[2] = info.tiny * torch.rand(256)  # subnormal row: amax / 127.5 underflows to 0 -> eps
    w[3, :] = 0.0
    w[3, 5] = info.tiny
    w[4] = w[4].sign() * info.max  # +-max
    w[5] = torch.randint(-127, 127, (256,)).float() + 0.5  # exact ties of scale 1 (row max 127.5)
    w[5, 0] = 127.5
    w[6] = (torch.arange(256) - 128).float() * 0.25  # every quotient a multiple of 1/4
    w[7] = w[7] * 1e4
    w[8] = w[8] * 1e-6
    w[9, :] = 0.0
    w[9, 7] = -1.0  # a single non-zero entry
    w[10] = torch.linspace(-1, 1, 256)
    check(w.to(dtype), "int8-ct")


def test_int8_ct_stacked_experts_equal_library():
    check(weight((3, 40, 96), torch.bfloat16, seed=8), "int8-ct")


# ------------------------------------------------------------------------------------------- INT4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("shape,group", [((16, 256), 128), ((5, 96), 32), ((13, 72), 8), ((64, 1024), 128)])
def test_int4_group_bytes_equal_library(dtype, symmetric, shape, group):
    w = weight(shape, dtype, seed=shape[1], scale=0.05, shift=0.0 if symmetric else 0.02)
    check(w, "int4-group", group=group, symmetric=symmetric)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_group_edge_groups_equal_library(dtype, symmetric):
    info = torch.finfo(dtype)
    w = weight((10, 128), torch.float32, seed=5, scale=0.05)
    w[0] = 0.0  # all-zero groups: scale eps; asymmetric zero point 0/0 -> NaN, cast to 0 by the library
    w[1, :32] = info.tiny * torch.rand(32)  # positive subnormal group: (max - min) / 15 may underflow
    w[1, 32:64] = -info.tiny * torch.rand(32)  # negative: min / 0 -> -inf, zero point clamped to 7
    w[2, :32] = 3.0  # constant positive group: min clamped to 0
    w[2, 32:64] = -3.0
    w[3] = torch.randint(-8, 8, (128,)).float() + 0.5  # ties of scale 1 (sym) / near ties (asym)
    w[3, ::32] = 7.5
    w[4] = w[4] * 1e3
    w[5] = w[5] * 1e-5
    w[6] = torch.linspace(-0.7, 1.3, 128)
    w[7, :64] = 0.0
    w[7, 3] = 1e-3
    limit = 1e30 if dtype == torch.bfloat16 else 3e4  # max - min must stay finite in the weight's dtype
    w[8] = w[8].sign() * limit
    check(w.to(dtype), "int4-group", group=32, symmetric=symmetric)


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_group_stacked_experts_equal_library(symmetric):
    check(weight((2, 24, 256), torch.float16, seed=9, shift=0.01), "int4-group", group=64, symmetric=symmetric)


# ------------------------------------------------------- scale dtype other than the weight's dtype


@pytest.mark.parametrize("fmt,symmetric", [("int8-ct", True), ("int4-group", True), ("int4-group", False)])
@pytest.mark.parametrize("wdtype,sdtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                           (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
def test_scale_dtype_override_equals_library(fmt, symmetric, wdtype, sdtype):
    """`scale_dtype` is the library's `scale_dtype`: the work is done in the wider of the two dtypes and
    the asymmetric zero point comes from the scale before it is rounded to `scale_dtype`."""
    w = weight((24, 256), wdtype, seed=21, scale=0.05, shift=0.0 if symmetric else 0.03)
    w[0] = 0.0
    check(w, fmt, group=64, symmetric=symmetric, scale_dtype=sdtype)


def test_fp16_asymmetric_range_overflow_is_refused():
    """max - min beyond fp16's range: the library would write an inf scale; we refuse, naming the tensor."""
    w = torch.zeros(2, 32, dtype=torch.float16)
    w[0, 0], w[0, 1] = 60000.0, -60000.0
    with pytest.raises(ValueError, match=r"down_proj.*max - min"):
        quantize_param(NAME, w, make_spec("int4-group", group_size=32, symmetric=False))


# ------------------------------------------------------------------------------------ properties


@st.composite
def hard_weights(draw, multiple: int):
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, 24))
    k = multiple * draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    mag = draw(st.sampled_from([1e-7, 1e-4, 1e-2, 1.0, 100.0, 1e4]))
    w = torch.randn(n, k, generator=g) * mag + draw(st.sampled_from([0.0, 0.5 * mag]))
    kind = draw(st.sampled_from(["plain", "zero", "ties", "negzero", "spike"]))
    r = draw(st.integers(0, n - 1))
    if kind == "zero":
        w[r] = 0.0
    elif kind == "ties":
        w[r] = (torch.randint(-16, 16, (k,), generator=g).float() + 0.5) * mag
    elif kind == "negzero":
        w[r] = -0.0
    elif kind == "spike":
        w[r, draw(st.integers(0, k - 1))] = 50.0 * mag
    w = w.clamp(-3e4, 3e4)  # fp16: max - min stays finite
    return w.to(dtype)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=hard_weights(multiple=1))
def test_property_int8_ct_equals_library(w):
    check(w, "int8-ct")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=hard_weights(multiple=32), symmetric=st.booleans(), group=st.sampled_from([8, 32]))
def test_property_int4_group_equals_library(w, symmetric, group):
    check(w, "int4-group", group=group, symmetric=symmetric)


def test_probe_weight_equals_library():
    """The fused paths' own probe tensor (every binade, subnormals, +-max, ties, near ties)."""
    for dtype in DTYPES:
        w = F.probe_weight(dtype, torch.device("cpu"), rows=45, cols=256)
        check(w, "int8-ct")
        check(w, "int4-group", group=32, symmetric=True)  # (+-max rows: max - min overflows, asymmetric refuses)

"""The fast paths (`fused='native'`: the C kernels, the CPU default; `fused='compile'`:
torch.compile) equal the eager path and plain references bit for bit, and fall back to eager
(one warning) when a kernel fails or differs."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slime_ascend.quant import compiled as C
from slime_ascend.quant import fused as F
from slime_ascend.quant import int_quant
from slime_ascend.quant import native as N
from slime_ascend.quant.fp8_block import quantize_fp8_block
from slime_ascend.quant.int_quant import quantize_int
from slime_ascend.quant.schemes import INT8_ASCEND_SCHEME, INT8_CT_SCHEME, FP8BlockScheme, int4_scheme

sys.path.insert(0, str(Path(__file__).parent))
from _quant_refs import expand_blocks, fp8_block_reference  # noqa: E402

FP8 = torch.float8_e4m3fn
SCHEMES = {"ascend": INT8_ASCEND_SCHEME, "ct": INT8_CT_SCHEME, "int4": int4_scheme(32)}
FP8_SMALL = FP8BlockScheme((16, 32))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def int8_sym_reference(w: torch.Tensor, divisor: float, qmin: int, qmax: int, zero_rule: str, in_dtype: bool):
    """Row by row: s = round_bf16(amax/divisor) (0 -> eps or 'quantise to 0'), q = clamp(round(x/s)),
    x / s in fp32, or in the weight's dtype (`in_dtype`: compressed-tensors' arithmetic)."""
    rows = w.reshape(-1, w.shape[-1])
    q = torch.empty(rows.shape, dtype=torch.int8)
    s = torch.empty(rows.shape[0], 1, dtype=torch.float32)
    for i in range(rows.shape[0]):
        x = rows[i].float()
        sc = (x.abs().max() / divisor).to(w.dtype).float()
        if sc == 0:
            sc = torch.tensor(torch.finfo(w.dtype).eps).to(w.dtype).float() if zero_rule == "eps" else sc
        s[i] = sc
        d = sc if sc != 0 else torch.tensor(1.0)
        t = (rows[i] / d.to(w.dtype)).float() if in_dtype else x / d
        q[i] = torch.round(t).clamp(qmin, qmax).to(torch.int8)
    return q.view(w.shape), s


@st.composite
def weights(draw, multiple: int = 1):
    """bf16 weights of awkward shapes (1xN, N not a multiple of the block, 3-D experts) with
    zero rows, ±max entries, exact .5 ties and -0.0."""
    experts = draw(st.sampled_from([None, 1, 3]))
    n = draw(st.integers(1, 40))  # n == 1 (and a single column block) take the eager path by design
    k = multiple * draw(st.integers(1, 9)) if multiple > 1 else draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    shape = (n, k) if experts is None else (experts, n, k)
    w = torch.randn(shape, generator=g) * 10.0 ** draw(st.integers(-3, 1))
    flat = w.view(-1, k)
    kind = draw(st.sampled_from(["plain", "zero_row", "max", "ties", "negzero"]))
    r = draw(st.integers(0, flat.shape[0] - 1))
    if kind == "zero_row":
        flat[r] = 0.0
    elif kind == "max":
        flat[r, 0] = torch.finfo(torch.bfloat16).max * (1 if seed % 2 else -1)
    elif kind == "ties":  # row max 127 -> scale 1 (ascend): every j + .5 is an exact tie
        flat[r] = torch.randint(-127, 127, (k,), generator=g).float() + 0.5
        flat[r, 0] = 127.0
    elif kind == "negzero":
        flat[r] = -0.0
    return w.to(torch.bfloat16)


KINDS = ["native", "compile"]


@pytest.fixture(autouse=True)
def _fresh_verdicts(monkeypatch):
    monkeypatch.setattr(C, "MIN_NUMEL", 0)  # small shapes take the fused path too
    F.reset()
    yield
    F.reset()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=weights(), name=st.sampled_from(["ascend", "ct"]))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.filterwarnings("error::RuntimeWarning")  # a disabled fused path fails the test
def test_int8_fused_equals_eager_and_reference(kind, w, name):
    scheme = SCHEMES[name]
    eager = quantize_int(w, scheme, fused=False)
    fast = quantize_int(w, scheme, fused=kind)
    assert torch.equal(bits(fast.q), bits(eager.q))
    assert torch.equal(bits(fast.scale), bits(eager.scale))
    ref_q, ref_s = int8_sym_reference(w, scheme.sym_divisor, scheme.qmin, scheme.qmax, scheme.zero_rule,
                                      in_dtype=scheme.arithmetic == "compressed-tensors")
    assert torch.equal(eager.q, ref_q)
    assert torch.equal(bits(eager.scale.float().reshape(-1, 1)), bits(ref_s))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=weights(multiple=32))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.filterwarnings("error::RuntimeWarning")  # a disabled fused path fails the test
def test_int4_group_fused_equals_eager(kind, w):
    eager = quantize_int(w, SCHEMES["int4"], fused=False)
    fast = quantize_int(w, SCHEMES["int4"], fused=kind)
    assert torch.equal(fast.q, eager.q) and torch.equal(bits(fast.scale), bits(eager.scale))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=weights())
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.filterwarnings("error::RuntimeWarning")  # a disabled fused path fails the test
def test_fp8_fused_equals_eager_and_reference(kind, w):
    eager = quantize_fp8_block(w, FP8_SMALL, fused=False)
    fast = quantize_fp8_block(w, FP8_SMALL, fused=kind)
    assert torch.equal(bits(fast[0]), bits(eager[0])) and torch.equal(bits(fast[1]), bits(eager[1]))
    for e in range(w.shape[0] if w.dim() == 3 else 1):
        we, qe, se = (w[e], eager[0][e], eager[1][e]) if w.dim() == 3 else (w, eager[0], eager[1])
        rq, rs = fp8_block_reference(we, *FP8_SMALL.block_size)
        assert torch.equal(bits(qe), bits(rq)) and torch.equal(bits(se), bits(rs))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.filterwarnings("error::RuntimeWarning")  # a disabled fused path fails the test
def test_fused_writes_into_out_and_handles_the_probe(kind):
    w = F.probe_weight(torch.bfloat16, torch.device("cpu"), rows=70, cols=300)
    out = quantize_int(w, INT8_CT_SCHEME, fused=False)
    mine = int_quant.IntQuantized(torch.full_like(out.q, 5), torch.zeros_like(out.scale), None)
    res = quantize_int(w, INT8_CT_SCHEME, fused=kind, out=mine)
    assert res.q is mine.q and torch.equal(mine.q, out.q) and torch.equal(bits(mine.scale), bits(out.scale))
    q8, s8 = quantize_fp8_block(w, FP8_SMALL, fused=False)
    mine8 = (torch.zeros_like(q8), torch.zeros_like(s8))
    res8 = quantize_fp8_block(w, FP8_SMALL, fused=kind, out=mine8)
    assert res8[0] is mine8[0] and torch.equal(bits(mine8[0]), bits(q8)) and torch.equal(mine8[1], s8)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_nan_and_inf_still_refused_on_the_fused_path(kind, bad):
    w = torch.randn(4, 256, dtype=torch.bfloat16)
    w[2, 7] = bad
    with pytest.raises(ValueError, match="NaN"):
        quantize_int(w, INT8_ASCEND_SCHEME, fused=kind)
    with pytest.raises(ValueError, match="NaN"):
        quantize_fp8_block(w, FP8_SMALL, fused=kind)


def _reciprocal_int(x, safe, out, qmin, qmax, reciprocal, quotient_dtype=None):  # a plausible but wrong kernel
    out.copy_((x.float() * torch.reciprocal(safe)).round().clamp(qmin, qmax).to(torch.int8))


def _reciprocal_fp8(x, scale, out, fmax):
    out.copy_((x.float() * torch.reciprocal(scale)).clamp(-fmax, fmax).to(FP8))


def _native_reciprocal_int(x, div, group, qmin, qmax, reciprocal, out, quotient_dtype=None):  # native signature
    d = expand_blocks(div, *x.shape, 1, group)
    out.copy_((x.float() * (d if reciprocal else torch.reciprocal(d))).round().clamp(qmin, qmax).to(torch.int8))


def _native_reciprocal_fp8(x, bn, bk, amax_floor, fmax, q, scale):
    n, k = x.shape
    xf = torch.nn.functional.pad(x.float().abs(), (0, -k % bk, 0, -n % bn))
    amax = xf.view(xf.shape[0] // bn, bn, -1, bk).amax(dim=(1, 3))
    scale.copy_(amax.clamp(min=amax_floor) / fmax)
    q.copy_((x.float() * torch.reciprocal(expand_blocks(scale, n, k, bn, bk))).clamp(-fmax, fmax).to(FP8))


WRONG = {"compile": (C, "int_quantize", _reciprocal_int, "fp8_quantize", _reciprocal_fp8),
         "native": (N, "int_quantize", _native_reciprocal_int, "fp8_block_quantize", _native_reciprocal_fp8)}
ABSMAX = {"compile": [(C, "absmax_last")], "native": [(N, "group_absmax"), (N, "fp8_block_quantize")]}


@pytest.mark.parametrize("kind", KINDS)
def test_self_check_catches_multiply_by_reciprocal_and_falls_back(monkeypatch, kind):
    """The probe has teeth: x * (1/s) instead of x / s is detected, and the result is the eager one."""
    mod, int_name, int_fn, fp8_name, fp8_fn = WRONG[kind]
    monkeypatch.setattr(mod, int_name, int_fn)
    monkeypatch.setattr(mod, fp8_name, fp8_fn)
    w = torch.randn(9, 300, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="differs from the eager path"):
        got = quantize_int(w, INT8_ASCEND_SCHEME, fused=kind)
    assert torch.equal(got.q, quantize_int(w, INT8_ASCEND_SCHEME, fused=False).q)
    with pytest.warns(RuntimeWarning, match="differs"):
        q, s = quantize_fp8_block(w, FP8BlockScheme(), fused=kind)
    assert torch.equal(bits(q), bits(quantize_fp8_block(w, fused=False)[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per key, not per call
        quantize_int(w, INT8_ASCEND_SCHEME, fused=kind)


@pytest.mark.parametrize("kind", KINDS)
def test_kernel_error_falls_back_with_one_warning(monkeypatch, kind):
    def boom(*a, **k):
        raise RuntimeError("no compiler")

    for mod, name in ABSMAX[kind]:
        monkeypatch.setattr(mod, name, boom)
    w = torch.randn(5, 64, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="no compiler"):
        got = quantize_int(w, INT8_CT_SCHEME, fused=kind)
    assert torch.equal(got.q, quantize_int(w, INT8_CT_SCHEME, fused=False).q)
    with pytest.warns(RuntimeWarning, match="no compiler"):
        quantize_fp8_block(w, FP8_SMALL, fused=kind)


@pytest.mark.parametrize("kind", KINDS)
def test_failure_after_the_self_check_falls_back(monkeypatch, kind):
    w = torch.randn(8, 256, dtype=torch.bfloat16)
    quantize_int(w, INT8_CT_SCHEME, fused=kind)  # self-check passed

    def limit(*a, **k):
        raise RuntimeError("recompile limit")

    monkeypatch.setattr(WRONG[kind][0], "int_quantize", limit)
    with pytest.warns(RuntimeWarning, match="recompile limit"):
        got = quantize_int(w, INT8_CT_SCHEME, fused=kind)
    assert torch.equal(got.q, quantize_int(w, INT8_CT_SCHEME, fused=False).q)


KERNELS = {kind: [*ABSMAX[kind], (WRONG[kind][0], WRONG[kind][1])] for kind in KINDS}


def record_kernel_calls(monkeypatch, kind: str) -> list[str]:
    """Replace every fused kernel of `kind` with a recorder; the names of the kernels called are returned
    (a kernel that raised would only make the fused path fall back with a warning)."""
    calls: list[str] = []
    for mod, name in KERNELS[kind]:
        monkeypatch.setattr(mod, name, lambda *a, _name=name, **k: calls.append(_name))
    return calls


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a fused path that was tried and dropped fails the test
def test_tiny_weights_stay_eager_when_compiling(monkeypatch):
    monkeypatch.setattr(C, "MIN_NUMEL", 1 << 16)
    calls = record_kernel_calls(monkeypatch, "compile")
    w = torch.randn(3, 64, dtype=torch.bfloat16)
    got = quantize_int(w, INT8_CT_SCHEME, fused="compile")
    ref_q, ref_s = int8_sym_reference(w, INT8_CT_SCHEME.sym_divisor, INT8_CT_SCHEME.qmin, INT8_CT_SCHEME.qmax,
                                      INT8_CT_SCHEME.zero_rule, in_dtype=True)
    assert torch.equal(got.q, ref_q) and torch.equal(bits(got.scale.float().reshape(-1, 1)), bits(ref_s))
    w8 = torch.randn(1, 4096, dtype=torch.bfloat16)
    q8, s8 = quantize_fp8_block(w8, fused="compile")
    rq, rs = fp8_block_reference(w8)
    assert torch.equal(bits(q8), bits(rq)) and torch.equal(bits(s8), bits(rs))
    assert calls == []


def test_switch(monkeypatch):
    cpu = torch.zeros(2, 2)
    monkeypatch.delenv(F.ENV_VAR, raising=False)
    assert F.requested(None) == "auto" and F.requested(True) == "auto" and F.requested(False) == "off"
    assert F.backend(None, cpu) == ("native" if N.available() else None)
    assert F.backend(None, torch.zeros(2, 2, device="meta")) is None  # accelerators stay eager by default
    assert F.backend(None, cpu.to(torch.float64)) is None  # a dtype the kernels do not read
    monkeypatch.setenv(F.ENV_VAR, "compile")
    assert F.requested(None) == "compile" and F.requested(False) == "off" and F.backend(None, cpu) == "compile"
    assert F.backend(None, torch.zeros(2, 2, device="meta")) is None  # only cpu / cuda get compiled kernels
    for off in ("off", "eager", "0"):
        monkeypatch.setenv(F.ENV_VAR, off)
        assert F.backend(None, cpu) is None and F.backend("native", cpu) == ("native" if N.available() else None)
    monkeypatch.setenv(F.ENV_VAR, "turbo")
    with pytest.raises(ValueError, match=F.ENV_VAR):
        F.requested(None)
    with pytest.raises(ValueError, match="fused='turbo'"):
        F.requested("turbo")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_asymmetric_schemes_stay_eager(monkeypatch, kind):
    """No fused kernel runs, and the result is an asymmetric 4-bit code: in [-8, 7], each group spanning the
    whole range, and (q - zp) * s within one step s of the weight."""
    calls = record_kernel_calls(monkeypatch, kind)
    w = torch.randn(3, 64, dtype=torch.bfloat16)
    got = quantize_int(w, int4_scheme(32, symmetric=False), fused=kind)
    assert calls == []
    q = got.q.view(3, 2, 32).int()
    assert got.zero_point is not None and int(q.min()) >= -8 and int(q.max()) <= 7
    assert (q.amax(-1) - q.amin(-1) >= 14).all()  # (max - min) / 15 per group: the codes span the range
    step = got.scale.float().view(3, 2, 1)
    deq = (q - got.zero_point.int().view(3, 2, 1)).float() * step
    assert ((deq - w.float().view(3, 2, 32)).abs() <= step).all()


@pytest.mark.parametrize("formulation", ["cast", "codes"])
def test_compiled_fp8_pass_rounds_like_torch_across_the_range(formulation):
    """Both compiled e4m3 roundings (`compiled.fp8_formulation` picks one per machine) are torch's
    float8_e4m3fn cast on every 97th fp32 bit pattern in [-448, 448] (all binades, e4m3 and fp32
    subnormals, ±0) and every e4m3 midpoint and its neighbours, through the compiled kernel."""
    pos = torch.arange(0, 0x43E00001, 97, dtype=torch.int64).to(torch.int32).view(torch.float32)
    allv = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    allv = allv[torch.isfinite(allv)].unique()
    mids = (allv[1:] + allv[:-1]) / 2
    near = torch.cat([(mids.view(torch.int32) + d).view(torch.float32) for d in (-1, 0, 1)])
    v = torch.cat([pos, near[near.abs() <= 448], torch.tensor([448.0, 0.0, -0.0])])
    v = torch.cat([v, -v])
    cols = 128
    v = torch.cat([v, v.new_zeros(-v.numel() % cols)]).view(-1, 1, cols)
    out = torch.empty(v.shape, dtype=FP8)
    C.fp8_quantize(v, torch.ones(v.shape[0], 1, 1), out, 448.0, formulation=formulation)
    assert torch.equal(bits(out), bits(v.to(FP8)))
    assert C.fp8_formulation("cpu") in ("cast", "codes") and C.fp8_formulation("cuda") == "codes"

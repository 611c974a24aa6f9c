"""Quantisation schemes (the numerics) and format specs (numerics + naming + policy).

One `IntScheme` describes every integer format we emit: the scale rule (divisor, eps
and how it is applied), the rounding order, the clamp range, and the dtype the scale is
rounded to before it is used. `FP8BlockScheme` does the same for FP8 block-wise.
A `QuantSpec` adds the on-disk format name and the name policy (which parameters are
quantised).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from .names import FORMATS, FP8_BLOCK, INT4_GROUP, INT4_NUMERICS, INT8_CT, INT8_W8A8, MXFP8  # noqa: E402,F401

ZeroRule = Literal["eps", "zero", "clamp"]
Arithmetic = Literal["fp32", "compressed-tensors"]


@dataclass(frozen=True)
class FP8BlockScheme:
    """float8_e4m3fn, one fp32 dequant multiplier (`weight_scale_inv`) per block.

    scale = max(amax(|block|), amax_floor) / fp8_max in fp32; q = clamp(x / scale, ±fp8_max)
    cast with round-to-nearest-even. `amax_floor` = 1e-12 is slime's offline
    `tools/convert_hf_to_fp8.py` rule: an all-zero block gets a tiny positive scale and
    quantises to exact zeros (never 0/0 = NaN).
    """

    block_size: tuple[int, int] = (128, 128)
    amax_floor: float = 1e-12
    fp8_max: float = 448.0

    def __post_init__(self) -> None:
        bs = tuple(int(b) for b in self.block_size)
        if len(bs) != 2 or min(bs) < 1:
            raise ValueError(f"block_size must be two positive ints, got {self.block_size!r}")
        object.__setattr__(self, "block_size", bs)


@dataclass(frozen=True)
class IntScheme:
    """Symmetric or asymmetric integer quantisation per output channel or per group.

    `arithmetic` "fp32" (vllm-ascend W8A8, torchao, slime numerics). Steps, all arithmetic in fp32
    on a row chunk:
      1. per group: mn, mx = min, max of the weight.
         symmetric:  raw = max(|mn|, |mx|) / sym_divisor
         asymmetric: raw = (max(mx, 0) - min(mn, 0)) / (qmax - qmin)
      2. zero_rule "clamp": raw = max(raw, eps).
      3. scale = raw rounded to `scale_round_dtype` (None: the weight's dtype), back in fp32.
      4. zero_rule "eps": scale == 0 -> eps (None: finfo(scale_round_dtype).eps);
         zero_rule "zero": scale stays 0 and the group quantises to 0 (vllm-ascend).
      5. asymmetric zero point zp = clamp(round(qmin - mn / scale), qmin, qmax).
      6. t = x / scale (or x * (1 / scale) when `reciprocal`);
         q = clamp(round(t + zp), qmin, qmax), or clamp(round(t) + zp, ...) when
         `zp_after_round`. `round` is half-to-even.

    `arithmetic` "compressed-tensors": the library's own `calculate_qparams` + `quantize` (0.20.1),
    run on the weight in the working dtype W = promote(weight dtype, scale dtype), where the scale
    dtype R is `scale_round_dtype` (None: the weight's dtype, so W is the model's bf16/fp16): every
    step below is rounded to W, as torch's W-typed ops do (fp32 math, one rounding to W).
      1. mn = min(min(x), 0), mx = max(max(x), 0) per group (exact).
         symmetric:  s0 = W(max(|mn|, |mx|) / sym_divisor); zp = 0
         asymmetric: s0 = W(W(mx - mn) / (qmax - qmin));
                     zp = round(clamp(W(qmin - W(mn / s0)), qmin, qmax)) from the scale before its
                     rounding to R and before the eps step; 0/0 (an all-zero group) is NaN, which
                     the library's int8 cast makes 0.
      2. scale = s0 rounded to R (clamped to R's finite range first, when `scale_round_dtype` is
         given: the library's `scale_dtype`); scale == 0 -> eps (finfo(R).eps).
      3. q = round(clamp(W(W(x / scale) + zp), qmin, qmax)), half-to-even.
    `zero_rule` must be "eps", `reciprocal` and `zp_after_round` False.

    The scale is stored as `scale_store_dtype` (None: the rounding dtype).
    """

    bits: int
    qmin: int
    qmax: int
    sym_divisor: float
    symmetric: bool = True
    group_size: int | None = None
    zero_rule: ZeroRule = "eps"
    eps: float | None = None
    reciprocal: bool = False
    zp_after_round: bool = False
    scale_round_dtype: torch.dtype | None = None
    scale_store_dtype: torch.dtype | None = None
    arithmetic: Arithmetic = "fp32"

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if not (-(1 << (self.bits - 1)) <= self.qmin < self.qmax <= (1 << (self.bits - 1)) - 1):
            raise ValueError(f"qmin/qmax {self.qmin}/{self.qmax} do not fit a signed int{self.bits}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size must be a positive int or None, got {self.group_size}")
        if self.zero_rule not in ("eps", "zero", "clamp"):
            raise ValueError(f"zero_rule must be 'eps', 'zero' or 'clamp', got {self.zero_rule!r}")
        if self.arithmetic not in ("fp32", "compressed-tensors"):
            raise ValueError(f"arithmetic must be 'fp32' or 'compressed-tensors', got {self.arithmetic!r}")
        if self.arithmetic == "compressed-tensors" and (self.zero_rule != "eps" or self.reciprocal
                                                        or self.zp_after_round):
            raise ValueError("arithmetic 'compressed-tensors' is the library's rule: zero_rule 'eps', x / scale, "
                             "zero point added before rounding")


# vllm-ascend online W8A8 rule (`quantization/online/weight_ops.py`): amax/127, +-127,
# zero rows -> scale 0, q 0.  Scale rounded to the model dtype (the engine's
# `weight_scale` parameter dtype) and stored as fp32 like msModelSlim writes it.
INT8_ASCEND_SCHEME = IntScheme(
    bits=8, qmin=-127, qmax=127, sym_divisor=127.0, zero_rule="zero", scale_store_dtype=torch.float32
)
# compressed-tensors `calculate_qparams` + `quantize`: amax/127.5, [-128, 127], zero scale ->
# finfo(scale dtype).eps, q = round(clamp(x / s)), every step in the model dtype as the library does.
INT8_CT_SCHEME = IntScheme(bits=8, qmin=-128, qmax=127, sym_divisor=127.5, zero_rule="eps",
                           arithmetic="compressed-tensors")


def int4_scheme(
    group_size: int = 128, symmetric: bool = True, numerics: str = "compressed-tensors"
) -> IntScheme:
    """INT4 group scheme. `numerics` picks whose formula is reproduced:

    - "compressed-tensors": amax/7.5 (sym) or (max-min)/15, range [-8, 7], x / s,
      zero scale -> eps, every step in the model dtype: the bytes the compressed-tensors library
      writes (see `IntScheme`, arithmetic "compressed-tensors").
    - "torchao": torchao `IntxFakeQuantizer` ranges: amax/7.5 (sym, range [-8, 7]) with
      scale >= finfo(weight dtype).smallest_normal, or (max-min)/15 with scale >= 1e-6 (asym,
      INT zero-point domain, shifted by -8 into the signed layout); q = round(x * (1/s)) + zp.
    - "slime": slime's `fake_int4_quant_cuda`: amax/7 (sym) or (max-min)/15, scale >= 1e-5,
      q = rint(x / s) + zp.
    The scale is rounded to the model dtype first in every case (pass a spec with
    scale dtype float32 to reproduce torchao's fp32 scales exactly; for "compressed-tensors" the
    scale dtype is the library's `scale_dtype`).
    """
    int4 = dict(bits=4, qmin=-8, qmax=7, symmetric=symmetric, group_size=group_size)
    if numerics == "compressed-tensors":
        return IntScheme(**int4, sym_divisor=7.5, arithmetic="compressed-tensors")
    if numerics == "torchao":
        return IntScheme(**int4, sym_divisor=7.5, zero_rule="clamp", eps=None if symmetric else 1e-6, reciprocal=True,
                         zp_after_round=True)
    if numerics == "slime":
        return IntScheme(**int4, sym_divisor=7.0, zero_rule="clamp", eps=1e-5, zp_after_round=True)
    raise ValueError(f"numerics must be one of {INT4_NUMERICS}, got {numerics!r}")


@dataclass(frozen=True)
class QuantSpec:
    """A complete on-disk/on-wire format.

    `ignore`: None -> the default name policy (decoder linear projections only);
    a tuple -> "ignore-list" mode: every Linear-like weight is quantised except modules
    matching these rules (exact module name, dotted prefix/suffix, or `re:<regex>`), as a
    checkpoint's `ignore` / `modules_to_not_convert` / FLOAT entries say.
    """

    fmt: str
    fp8: FP8BlockScheme | None = None
    int_scheme: IntScheme | None = None
    ignore: tuple[str, ...] | None = None
    int4_numerics: str = "compressed-tensors"
    extra_ignore: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {self.fmt!r}")
        if self.fmt == FP8_BLOCK and self.fp8 is None:
            raise ValueError("fmt 'fp8-block' needs an FP8BlockScheme in `fp8`")
        if self.fmt not in (FP8_BLOCK, MXFP8) and self.int_scheme is None:  # mxfp8: a fixed rule (quant.mxfp8)
            raise ValueError(f"fmt {self.fmt!r} needs an IntScheme in `int_scheme`")


def make_spec(
    fmt: str,
    *,
    block_size: tuple[int, int] = (128, 128),
    group_size: int = 128,
    symmetric: bool = True,
    numerics: str = "compressed-tensors",
    scale_dtype: torch.dtype | None = None,
    ignore: tuple[str, ...] | list[str] | None = None,
    extra_ignore: tuple[str, ...] | list[str] = (),
) -> QuantSpec:
    """Build the spec of a format name in `FORMATS`.

    `scale_dtype` overrides the dtype the INT scale is rounded to (default: the weight's
    dtype, which is the dtype the serving engine keeps it in). For the compressed-tensors
    numerics (`int8-ct`, `int4-group` "compressed-tensors") it is the library's `scale_dtype`:
    the work is then done in promote(weight dtype, scale_dtype) (see `IntScheme`).
    """
    extra = tuple(extra_ignore)
    ign = None if ignore is None else tuple(ignore)
    if fmt == FP8_BLOCK:
        return QuantSpec(fmt, fp8=FP8BlockScheme(tuple(block_size)), ignore=ign, extra_ignore=extra)
    if fmt == MXFP8:
        return QuantSpec(fmt, ignore=ign, extra_ignore=extra)
    if fmt == INT8_W8A8:
        scheme = INT8_ASCEND_SCHEME
    elif fmt == INT8_CT:
        scheme = INT8_CT_SCHEME
    elif fmt == INT4_GROUP:
        scheme = int4_scheme(group_size, symmetric, numerics)
    else:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if scale_dtype is not None:
        store = scheme.scale_store_dtype if fmt == INT8_W8A8 else scale_dtype
        scheme = replace(scheme, scale_round_dtype=scale_dtype, scale_store_dtype=store)
    return QuantSpec(fmt, int_scheme=scheme, ignore=ign, int4_numerics=numerics, extra_ignore=extra)

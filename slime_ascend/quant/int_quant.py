"""Integer quantisation (INT8 per channel, INT4 per group) from one code path.

`quantize_int` implements `IntScheme` (see its docstring for the exact steps) on row
chunks: the weight is viewed as [rows, K] (leading dims, e.g. stacked experts, are
flattened into rows; groups never cross rows). `pack_int4` / `unpack_int4` are the
compressed-tensors `pack-quantized` layout: 8 values per int32, element j of a word in
bits 4j..4j+3 (low first), stored as value + 8.
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple

import torch

from ._common import (
    DEFAULT_CHUNK_ELEMS, all_finite, check_float_weight, check_out, clamp_is_noop, raise_if_not_finite,
    rows_per_chunk,
)
from . import compiled as _compiled
from . import fused as _fused
from . import native as _native
from .schemes import IntScheme


class IntQuantized(NamedTuple):
    q: torch.Tensor  # int8, same shape as the weight, values in [qmin, qmax]
    scale: torch.Tensor  # [..., N, G] in the scheme's store dtype (G = 1 per channel)
    zero_point: torch.Tensor | None  # int8 [..., N, G], asymmetric only


def _group(scheme: IntScheme, k: int, name: str) -> int:
    g = k if scheme.group_size is None else scheme.group_size
    if k % g:
        raise ValueError(f"{name}: in_features {k} is not a multiple of group_size {g}; "
                         f"pick a group_size that divides it")
    return g


def quantize_int(
    weight: torch.Tensor,
    scheme: IntScheme,
    *,
    name: str = "weight",
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    out: IntQuantized | None = None,
    fused: bool | str | None = None,
) -> IntQuantized:
    """Quantise a [N, K] or [E, N, K] float weight with `scheme`.

    `out`: optional preallocated IntQuantized (q, scale, zero_point) to write into.
    `fused`: which kernels run the bulk passes of symmetric schemes (see `quant.fused`): False /
    'off' eager, True / 'auto' the native CPU kernels where they build, 'native', 'compile'; every
    fast path is self-checked bit-identical to eager on first use. None: `SLIME_ASCEND_QUANT_FUSED`
    (default auto). Asymmetric schemes always run eager.
    """
    check_float_weight(weight, name)
    rows = math.prod(weight.shape[:-1])
    kind = _fused.backend(fused, weight) if scheme.symmetric else None
    if (kind is not None and _fused.eligible(kind, weight.numel(), rows, weight.shape[-1])
            and _fused_ok(scheme, weight.dtype, weight.device, kind)
            and (_fused.requested(fused) != "auto" or _faster_than_eager(scheme, weight, kind))):
        try:
            r, ok = _quantize_int(weight, scheme, name, chunk_elems, out, kind)
            _raise_if_not_finite(ok, weight, scheme, name)
            return r
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - kernel failure: eager from now on
            _fused.disable(_fused_key(scheme, weight, kind), e)
    r, ok = _quantize_int(weight, scheme, name, chunk_elems, out, None)
    _raise_if_not_finite(ok, weight, scheme, name)
    return r


def _raise_if_not_finite(ok: torch.Tensor, weight: torch.Tensor, scheme: IntScheme, name: str) -> None:
    """A non-finite scale: a NaN/inf weight, or (compressed-tensors arithmetic, asymmetric) max - min
    beyond the working dtype's range, where the library would write an inf scale."""
    if (not bool(ok) and not scheme.symmetric and scheme.arithmetic == "compressed-tensors"
            and all_finite(weight)):
        work = torch.promote_types(weight.dtype, scheme.scale_round_dtype or weight.dtype)
        raise ValueError(f"{name}: max - min of a group exceeds the {work} range, so its scale would be inf; "
                         f"refusing to quantise it (use the symmetric scheme, or a float32 scale dtype)")
    raise_if_not_finite(ok, name)


def _fused_key(scheme: IntScheme, weight: torch.Tensor, kind: str) -> tuple:
    return ("int", kind, scheme, weight.dtype, weight.device.type)


def _faster_than_eager(scheme: IntScheme, weight: torch.Tensor, kind: str) -> bool:
    """`auto`: keep the fast path only where it is not slower than eager here (timed once, cached)."""
    def setup():
        w = _fused.calibration_weight(weight.dtype, weight.device, scheme.group_size or 1)
        out = _quantize_int(w, scheme, "calibration", DEFAULT_CHUNK_ELEMS, None, None)[0]
        return (lambda: _quantize_int(w, scheme, "calibration", DEFAULT_CHUNK_ELEMS, out, kind),
                lambda: _quantize_int(w, scheme, "calibration", DEFAULT_CHUNK_ELEMS, out, None))

    return _fused.faster_than_eager(_fused_key(scheme, weight, kind), setup)


def _quantize_int(
    weight: torch.Tensor, scheme: IntScheme, name: str, chunk_elems: int, out: IntQuantized | None, kind: str | None,
) -> IntQuantized:
    *lead, n, k = weight.shape
    g = _group(scheme, k, name) if k else 1
    ngroups = k // g if k else 0
    round_dtype = scheme.scale_round_dtype or weight.dtype
    store_dtype = scheme.scale_store_dtype or round_dtype
    dev = weight.device
    if out is None:
        q = torch.empty(weight.shape, dtype=torch.int8, device=dev)
        scale = torch.empty((*lead, n, ngroups), dtype=store_dtype, device=dev)
        zp = None if scheme.symmetric else torch.empty((*lead, n, ngroups), dtype=torch.int8, device=dev)
    else:
        q, scale, zp = out
        check_out(q, weight.shape, torch.int8, f"{name}: out.q")
        check_out(scale, (*lead, n, ngroups), store_dtype, f"{name}: out.scale")
        if scheme.symmetric != (zp is None):
            raise ValueError(f"{name}: out.zero_point must be {'None' if scheme.symmetric else 'a tensor'}")
        if zp is not None:
            check_out(zp, (*lead, n, ngroups), torch.int8, f"{name}: out.zero_point")
    m = math.prod(lead) * n
    if m == 0 or k == 0:
        return IntQuantized(q, scale, zp), torch.ones((), dtype=torch.bool)
    w2 = weight.reshape(m, k)
    q2, s2 = q.view(m, k), scale.view(m, ngroups)
    z2 = None if zp is None else zp.view(m, ngroups)
    eps = scheme.eps
    if eps is None:
        eps = torch.finfo(round_dtype).eps if scheme.zero_rule == "eps" else torch.finfo(weight.dtype).smallest_normal
    if kind == "compile":
        return IntQuantized(q, scale, zp), _quantize_sym_compiled(w2, scheme, g, eps, round_dtype, q2, s2)
    if kind == "native":
        return IntQuantized(q, scale, zp), _quantize_sym_native(w2, scheme, g, eps, round_dtype, q2, s2)
    step = rows_per_chunk(k, chunk_elems)
    buf = torch.empty(min(step, m) * k, dtype=torch.float32, device=dev)
    ok = torch.ones((), dtype=torch.bool, device=dev)
    qmin, qmax = float(scheme.qmin), float(scheme.qmax)
    rq = _rounding(scheme, weight.dtype)
    for r0 in range(0, m, step):
        r1 = min(m, r0 + step)
        rows = r1 - r0
        y = buf[: rows * k].view(rows, ngroups, g)
        y.view(rows, k).copy_(w2[r0:r1])  # fp32 staging; bf16/fp16 -> fp32 is exact
        mx, mn = y.amax(dim=-1), y.amin(dim=-1)  # (separate reductions vectorise; aminmax does not on CPU)
        if scheme.symmetric:
            amax = torch.maximum(mx.abs_(), mn.abs())
            raw = _round(amax / scheme.sym_divisor, rq)
        elif scheme.arithmetic == "compressed-tensors":
            mn.clamp_(max=0.0)
            raw = _round(_round(mx.clamp_(min=0.0).sub_(mn), rq).div_(qmax - qmin), rq)
            # zero point from the scale before its rounding to the scale dtype and the eps step (0/0 -> 0)
            z = _round(_round(mn / raw, rq).neg_().add_(qmin), rq).clamp_(qmin, qmax).nan_to_num_(0.0).round_()
        else:
            mn.clamp_(max=0.0)
            raw = mx.clamp_(min=0.0).sub_(mn).div_(qmax - qmin)
        s, safe = _scale(raw, scheme, eps, round_dtype)
        ok = ok & torch.isfinite(s).all()
        s2[r0:r1].copy_(s)
        if scheme.reciprocal:
            inv = torch.reciprocal(safe)
            y.mul_(inv.unsqueeze(-1))
        else:
            y.div_(safe.unsqueeze(-1))
        _round_(y, rq)
        if scheme.symmetric:
            y.round_()
            # |x| <= amax and division, multiplication and the roundings are monotone: |q| <= round(amax / s),
            # so when that is inside the range the clamp is a no-op and is skipped
            tmax = _round(amax * inv if scheme.reciprocal else amax / safe, rq).round_()
            if not clamp_is_noop(tmax, min(qmax, -qmin)):
                y.clamp_(qmin, qmax)
        else:
            if scheme.arithmetic == "compressed-tensors":
                _round_(y.add_(z.unsqueeze(-1)), rq).round_()
            elif scheme.zp_after_round:
                z = mn.div_(safe).round_().neg_().add_(qmin).clamp_(qmin, qmax)
                y.round_().add_(z.unsqueeze(-1))
            else:
                z = mn.div_(safe).neg_().add_(qmin).round_().clamp_(qmin, qmax)
                y.add_(z.unsqueeze(-1)).round_()
            z2[r0:r1].copy_(z)
            y.clamp_(qmin, qmax)
        q2[r0:r1].copy_(y.view(rows, k))
    return IntQuantized(q, scale, zp), ok


def _rounding(scheme: IntScheme, weight_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype every step is rounded to for `scheme` (the fp32 work is then that dtype's arithmetic),
    or None when the steps are plain fp32: the working dtype of arithmetic "compressed-tensors" when it
    is bf16 or fp16."""
    if scheme.arithmetic != "compressed-tensors":
        return None
    work = torch.promote_types(weight_dtype, scheme.scale_round_dtype or weight_dtype)
    return work if work in (torch.bfloat16, torch.float16) else None


def _round(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """fp32 `t` rounded to `dtype` (round to nearest even, as torch's cast), as fp32; `t` when None."""
    return t if dtype is None else t.to(dtype).float()


def _round_(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """In place: fp32 `t` rounded to `dtype` (None: unchanged)."""
    return t if dtype is None else t.copy_(t.to(dtype))


def _scale(raw: torch.Tensor, scheme: IntScheme, eps: float, round_dtype: torch.dtype):
    """Steps 2-4 of `IntScheme` on the raw fp32 scale: (scale, divisor with zeros made safe)."""
    if scheme.zero_rule == "clamp":
        raw.clamp_(min=eps)
    if scheme.arithmetic == "compressed-tensors" and scheme.scale_round_dtype is not None:
        info = torch.finfo(round_dtype)  # the library's `round_to_quantized_type_dtype` (with a scale_dtype only)
        raw = raw.clamp(info.min, info.max)
    s = raw.to(round_dtype).float()
    if scheme.zero_rule == "eps":
        s = torch.where(s == 0, torch.tensor(eps, dtype=torch.float32, device=raw.device), s)
        s = s.to(round_dtype).float()
    safe = torch.where(s == 0, torch.ones_like(s), s) if scheme.zero_rule == "zero" else s
    return s, safe


def _quantize_sym_native(
    w2: torch.Tensor, scheme: IntScheme, g: int, eps: float, round_dtype: torch.dtype,
    q2: torch.Tensor, s2: torch.Tensor,
) -> torch.Tensor:
    """The symmetric steps on the whole [M, K] weight with the native |max| and divide/round/clamp
    kernels, one sweep each; returns `ok`."""
    if w2.shape[1] > 1 and w2.stride(1) != 1:
        w2 = w2.contiguous()
    rq = _rounding(scheme, w2.dtype)
    s, safe = _scale(_round(_native.group_absmax(w2, g) / scheme.sym_divisor, rq), scheme, eps, round_dtype)
    s2.copy_(s)
    div = torch.reciprocal(safe) if scheme.reciprocal else safe
    _native.int_quantize(w2, div.contiguous(), g, float(scheme.qmin), float(scheme.qmax), scheme.reciprocal, q2,
                         quotient_dtype=rq)
    return torch.isfinite(s).all()


def _quantize_sym_compiled(
    w2: torch.Tensor, scheme: IntScheme, g: int, eps: float, round_dtype: torch.dtype,
    q2: torch.Tensor, s2: torch.Tensor,
) -> torch.Tensor:
    """The symmetric steps on the whole [M, K] weight with the compiled bulk passes; returns `ok`."""
    m, k = w2.shape
    # per channel: 2-D ([M, K] / [M, 1]); per group: 3-D ([M, G, g] / [M, G, 1])
    x, q = (w2, q2) if g == k else (w2.unflatten(1, (k // g, g)), q2.view(m, k // g, g))
    amax = _compiled.absmax_last(x.unsqueeze(1) if g == k else x)
    rq = _rounding(scheme, w2.dtype)
    s, safe = _scale(_round(amax / scheme.sym_divisor, rq), scheme, eps, round_dtype)
    s2.copy_(s)
    div = torch.reciprocal(safe) if scheme.reciprocal else safe
    _compiled.int_quantize(x, div if g == k else div.unsqueeze(-1), q, float(scheme.qmin), float(scheme.qmax),
                           scheme.reciprocal, quotient_dtype=rq)
    return torch.isfinite(s).all()


def _fused_ok(scheme: IntScheme, dtype: torch.dtype, device: torch.device, kind: str) -> bool:
    def check() -> bool:
        g = 32 if scheme.group_size is None else scheme.group_size
        rounding = scheme.scale_round_dtype or dtype
        ties = _fused.near_ties(dtype, device, lambda a: (a / scheme.sym_divisor).to(rounding).float(),
                                torch.round, width=g)
        probes = [_fused.probe_weight(dtype, device, cols=389 if scheme.group_size is None else 3 * g)]
        if ties.numel():
            probes.append(ties)  # one group per row
        for w in probes:
            a, _ = _quantize_int(w, scheme, "probe", DEFAULT_CHUNK_ELEMS, None, None)
            b, _ = _quantize_int(w, scheme, "probe", DEFAULT_CHUNK_ELEMS, None, kind)
            if not (_fused.bits_equal(a.q, b.q) and _fused.bits_equal(a.scale, b.scale)):
                return False
        return True

    return _fused.verified(("int", kind, scheme, dtype, device.type), check)  # = _fused_key


def dequantize_int(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """(q - zp) · scale per group, computed in fp32, cast to `dtype`.

    `scale` is [..., N, G]; the group size is K / G.
    """
    *lead, n, k = q.shape
    ngroups = scale.shape[-1]
    if tuple(scale.shape[:-1]) != (*lead, n) or (ngroups and k % ngroups):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not fit q shape {tuple(q.shape)}")
    x = q.float()
    if zero_point is not None:
        x = x.view(*lead, n, ngroups, k // ngroups) - zero_point.float().unsqueeze(-1)
    else:
        x = x.view(*lead, n, ngroups, k // ngroups)
    return (x * scale.float().unsqueeze(-1)).view(q.shape).to(dtype)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Pack int8 values in [-8, 7] along the last dim: [..., C] -> int32 [..., ceil(C/8)]."""
    if values.dtype != torch.int8:
        raise TypeError(f"pack_int4 expects int8 values, got {values.dtype}")
    *lead, c = values.shape
    words = math.ceil(c / 8)
    u = values.view(torch.uint8)
    if words * 8 != c:
        u = torch.nn.functional.pad(u, (0, words * 8 - c), value=0xF8)  # pad value -8 -> nibble 0
    u = u.reshape(*lead, words * 4, 2)
    # two's-complement nibble of v is v & 0xF, and (v + 8) & 0xF == (v & 0xF) ^ 0x8
    byte = ((u[..., 0] & 0x0F) | (u[..., 1] << 4)) ^ 0x88
    if sys.byteorder == "little":
        return byte.contiguous().view(torch.int32).reshape(*lead, words)
    b = byte.reshape(*lead, words, 4).to(torch.int64)  # big-endian hosts: assemble words arithmetically
    word = (b << torch.tensor([0, 8, 16, 24], dtype=torch.int64, device=values.device)).sum(-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of `pack_int4`: int32 [..., W] -> int8 [..., cols]."""
    if packed.dtype != torch.int32:
        raise TypeError(f"unpack_int4 expects int32, got {packed.dtype}")
    *lead, words = packed.shape
    if cols > words * 8:
        raise ValueError(f"cols {cols} exceeds the {words * 8} values packed in {words} words")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nib = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nib.reshape(*lead, words * 8)[..., :cols] - 8).to(torch.int8)


def pack_int4_zero_point(zp: torch.Tensor) -> torch.Tensor:
    """compressed-tensors packs zero points along the output dim: [..., N, G] -> [..., ceil(N/8), G]."""
    return pack_int4(zp.transpose(-1, -2)).transpose(-1, -2).contiguous()


def unpack_int4_zero_point(packed: torch.Tensor, rows: int) -> torch.Tensor:
    return unpack_int4(packed.transpose(-1, -2).contiguous(), rows).transpose(-1, -2).contiguous()

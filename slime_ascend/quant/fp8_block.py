"""FP8 (e4m3fn) block-wise quantisation with fp32 `weight_scale_inv` per block.

Numerics (see `FP8BlockScheme`): s = max(amax, 1e-12) / 448 in fp32, q = clamp(x / s, ±448)
cast round-to-nearest-even; W ≈ fp32(q) · s per block. Shapes need not be multiples of
the block (edge blocks are partial); 3-D inputs are stacked experts [E, N, K], each
quantised as its own matrix. Work is done in row chunks of whole row-blocks so the fp32
staging stays bounded.
"""

from __future__ import annotations

import math

import torch

from ._common import (
    DEFAULT_CHUNK_ELEMS, check_float_weight, check_out, clamp_is_noop, raise_if_not_finite, rows_per_chunk,
)
from . import compiled as _compiled
from . import fused as _fused
from . import native as _native
from .schemes import FP8BlockScheme

FP8_DTYPE = torch.float8_e4m3fn


def fp8_scale_shape(shape: torch.Size | tuple[int, ...], block_size: tuple[int, int]) -> tuple[int, ...]:
    *lead, n, k = shape
    return (*lead, math.ceil(n / block_size[0]), math.ceil(k / block_size[1]))


def quantize_fp8_block(
    weight: torch.Tensor,
    scheme: FP8BlockScheme = FP8BlockScheme(),
    *,
    name: str = "weight",
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    fused: bool | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (q float8_e4m3fn, same shape as `weight`; scale_inv fp32 [.., ceil(N/bn), ceil(K/bk)]).

    `out`: optional preallocated (q, scale_inv) to write into (e.g. a reused sync buffer).
    `fused`: which kernels run the bulk passes (see `quant.fused`): False / 'off' eager, True /
    'auto' the native CPU kernels where they build, 'native', 'compile'; every fast path is
    self-checked bit-identical to eager on first use. None: `SLIME_ASCEND_QUANT_FUSED` (default auto).
    """
    check_float_weight(weight, name)
    n, k = weight.shape[-2:]
    kind = _fused.backend(fused, weight)
    if not 0 < scheme.fp8_max <= _native.FP8_MAX_SUPPORTED:  # both fast paths round with e4m3fn's range
        kind = None
    if (kind is not None and _fused.eligible(kind, weight.numel(), n, k // scheme.block_size[1])
            and _fused_ok(scheme, weight.dtype, weight.device, kind)
            and (_fused.requested(fused) != "auto" or _faster_than_eager(scheme, weight.dtype, weight.device, kind))):
        try:
            q, s, ok = _quantize(weight, scheme, name, chunk_elems, out, kind)
            raise_if_not_finite(ok, name)
            return q, s
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - kernel failure: eager from now on
            _fused.disable(("fp8", kind, scheme, weight.dtype, weight.device.type), e)
    q, s, ok = _quantize(weight, scheme, name, chunk_elems, out, None)
    raise_if_not_finite(ok, name)
    return q, s


def _quantize(
    weight: torch.Tensor, scheme: FP8BlockScheme, name: str, chunk_elems: int,
    out: tuple[torch.Tensor, torch.Tensor] | None, kind: str | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s_shape = fp8_scale_shape(weight.shape, scheme.block_size)
    if out is None:
        q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
        s = torch.empty(s_shape, dtype=torch.float32, device=weight.device)
    else:
        q, s = out
        check_out(q, weight.shape, FP8_DTYPE, f"{name}: out[0]")
        check_out(s, s_shape, torch.float32, f"{name}: out[1]")
    ok = torch.ones((), dtype=torch.bool, device=weight.device)
    one = {None: _quantize_2d, "compile": _quantize_2d_compiled, "native": _quantize_2d_native}[kind]
    if weight.dim() == 2:
        ok = one(weight, q, s, scheme, chunk_elems, ok)
    else:
        for e in range(weight.shape[0]):
            ok = one(weight[e], q[e], s[e], scheme, chunk_elems, ok)
    return q, s, ok


def _quantize_2d(
    w: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor, scheme: FP8BlockScheme, chunk_elems: int,
    ok: torch.Tensor,
) -> torch.Tensor:
    bn, bk = scheme.block_size
    n, k = w.shape
    if n == 0 or k == 0:
        return ok
    kb = math.ceil(k / bk)
    k_main = (k // bk) * bk
    step = min(rows_per_chunk(k, chunk_elems, bn), math.ceil(n / bn) * bn)
    buf = torch.empty(step * k, dtype=torch.float32, device=w.device)
    fmax = scheme.fp8_max
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        rows = r1 - r0
        full = rows // bn
        tail = rows - full * bn
        nbr = full + (1 if tail else 0)
        y = buf[: rows * k].view(rows, k)
        y.copy_(w[r0:r1])  # fp32 staging (exact)
        # |max| per (row, column block): contiguous reductions along the row (vectorised), then
        # over the block's rows on the 1/bk-sized result
        ra = torch.empty((rows, kb), dtype=torch.float32, device=w.device)
        if k_main:
            yg = y[:, :k_main].unflatten(1, (k_main // bk, bk))
            torch.maximum(yg.amax(dim=-1), yg.amin(dim=-1).neg_(), out=ra[:, : k_main // bk])
        if k_main < k:
            yt = y[:, k_main:]
            torch.maximum(yt.amax(dim=-1), yt.amin(dim=-1).neg_(), out=ra[:, kb - 1])
        amax_f, scale = _block_scale(ra, scheme, full, tail)
        ok = ok & torch.isfinite(scale).all()
        s_out[r0 // bn : r0 // bn + nbr].copy_(scale)
        if k_main:  # whole column blocks: broadcast the block scale, no expanded copy
            kbm = k_main // bk
            if full:
                y[: full * bn, :k_main].unflatten(1, (kbm, bk)).unflatten(0, (full, bn)).div_(
                    scale[:full, None, :kbm, None])
            if tail:
                y[full * bn :, :k_main].unflatten(1, (kbm, bk)).div_(scale[full, None, :kbm, None])
        if k_main < k:
            if full:
                y[: full * bn, k_main:].unflatten(0, (full, bn)).div_(scale[:full, None, kb - 1 :])
            if tail:
                y[full * bn :, k_main:].div_(scale[full, kb - 1 :])
        # |x| <= block amax and division is monotone, so |y| <= tmax = max(amax / scale) (about fmax,
        # an ulp above at most). The clamp is skipped when it cannot change the cast: tmax <= fmax, or
        # tmax itself casts to fmax (the cast is monotone, so everything in (fmax, tmax] does too).
        tmax = (amax_f / scale).amax()
        if not (clamp_is_noop(tmax, fmax) or clamp_is_noop(tmax.to(FP8_DTYPE).float(), fmax)):
            y.clamp_(-fmax, fmax)
        q_out[r0:r1].copy_(y)
    return ok


def _block_scale(ra: torch.Tensor, scheme: FP8BlockScheme, full: int, tail: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(row, column block) |max| `ra` -> (clamped block amax, scale) for `full` row blocks + a
    `tail`-row partial block."""
    bn = scheme.block_size[0]
    amax = torch.empty((full + (1 if tail else 0), ra.shape[1]), dtype=torch.float32, device=ra.device)
    if full:
        torch.amax(ra[: full * bn].view(full, bn, ra.shape[1]), dim=1, out=amax[:full])
    if tail:
        torch.amax(ra[full * bn :], dim=0, out=amax[full])
    return _scale_of(amax, scheme)


def _scale_of(amax: torch.Tensor, scheme: FP8BlockScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Block |max| (fp32, clamped in place) -> (clamped amax, scale = amax / fp8_max): the scale rule
    (the native kernel, `native_kernels.c` `sa_fp8_block_quantize`, applies the same fp32 ops)."""
    amax_f = amax.clamp_(min=scheme.amax_floor)
    return amax_f, amax_f / scheme.fp8_max


def _quantize_2d_native(
    w: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor, scheme: FP8BlockScheme, chunk_elems: int,
    ok: torch.Tensor,
) -> torch.Tensor:
    """`_quantize_2d` as one native pass (block maxima, `_scale_of`'s rule, divide/clamp/cast)."""
    n, k = w.shape
    if n == 0 or k == 0:
        return ok
    if k > 1 and w.stride(1) != 1:
        w = w.contiguous()
    _native.fp8_block_quantize(w, *scheme.block_size, scheme.amax_floor, scheme.fp8_max, q_out, s_out)
    return ok & torch.isfinite(s_out).all()


def _quantize_2d_compiled(
    w: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor, scheme: FP8BlockScheme, chunk_elems: int,
    ok: torch.Tensor,
) -> torch.Tensor:
    """`_quantize_2d` on the whole matrix with the compiled |max| and divide/clamp/cast passes (the cast
    is inductor's own under AVX-512, else integer rounding in torch ops: `compiled.fp8_formulation`)."""
    bn, bk = scheme.block_size
    n, k = w.shape
    if n == 0 or k == 0:
        return ok
    kb, kbm = math.ceil(k / bk), k // bk
    k_main = kbm * bk
    ra = torch.empty((n, kb), dtype=torch.float32, device=w.device)
    if kbm:
        ra[:, :kbm] = _compiled.absmax_last(w[:, :k_main].unflatten(1, (kbm, bk)))
    if k_main < k:
        yt = w[:, k_main:].float()
        torch.maximum(yt.amax(dim=-1), yt.amin(dim=-1).neg_(), out=ra[:, kb - 1])
    _, scale = _block_scale(ra, scheme, n // bn, n % bn)
    s_out.copy_(scale)
    rows = scale.repeat_interleave(bn, dim=0)[:n]  # [n, kb]: each row's block scales
    if kbm:
        _compiled.fp8_quantize(w[:, :k_main].unflatten(1, (kbm, bk)), rows[:, :kbm, None].contiguous(),
                            q_out[:, :k_main].unflatten(1, (kbm, bk)), scheme.fp8_max)
    if k_main < k:
        q_out[:, k_main:].copy_(w[:, k_main:].float().div_(rows[:, kb - 1 :]).clamp_(-scheme.fp8_max, scheme.fp8_max))
    return ok & torch.isfinite(scale).all()


def _fused_ok(scheme: FP8BlockScheme, dtype: torch.dtype, device: torch.device, kind: str) -> bool:
    def check() -> bool:
        bn, bk = scheme.block_size
        fmax = scheme.fp8_max
        probes = [_fused.probe_weight(dtype, device, rows=2 * bn + 5, cols=3 * bk + 7)]
        ties = _fused.near_ties(dtype, device, lambda a: a.clamp(min=scheme.amax_floor) / fmax,
                                lambda t: t.clamp(-fmax, fmax).to(FP8_DTYPE).view(torch.uint8), groups=8)
        if ties.numel():  # one block per near-tie row: [bn, groups * bk], zeros elsewhere
            w = torch.zeros(max(bn, 2), ties.shape[0] * bk, dtype=dtype, device=device)
            w.view(w.shape[0], ties.shape[0], bk)[0, :, : min(bk, ties.shape[1])] = ties[:, :bk]
            probes.append(w)
        for w in probes:
            a = _quantize(w, scheme, "probe", DEFAULT_CHUNK_ELEMS, None, None)
            b = _quantize(w, scheme, "probe", DEFAULT_CHUNK_ELEMS, None, kind)
            if not (bool(a[2]) and bool(b[2]) and _fused.bits_equal(a[0], b[0]) and _fused.bits_equal(a[1], b[1])):
                return False
        return True

    return _fused.verified(("fp8", kind, scheme, dtype, device.type), check)


def _faster_than_eager(scheme: FP8BlockScheme, dtype: torch.dtype, device: torch.device, kind: str) -> bool:
    """`auto`: keep the fast path only where it is not slower than eager here (timed once, cached)."""
    def setup():
        w = _fused.calibration_weight(dtype, device)
        out = (torch.empty(w.shape, dtype=FP8_DTYPE, device=device),
               torch.empty(fp8_scale_shape(w.shape, scheme.block_size), dtype=torch.float32, device=device))
        return (lambda: _quantize(w, scheme, "calibration", DEFAULT_CHUNK_ELEMS, out, kind),
                lambda: _quantize(w, scheme, "calibration", DEFAULT_CHUNK_ELEMS, out, None))

    return _fused.faster_than_eager(("fp8", kind, scheme, dtype, device.type), setup)


def dequantize_fp8_block(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """fp32(q) · scale_inv broadcast per block, computed in fp32 and cast to `dtype`."""
    if q.dtype != FP8_DTYPE:
        raise TypeError(f"q must be float8_e4m3fn, got {q.dtype}")
    expected = fp8_scale_shape(q.shape, block_size)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(q.shape)} "
                         f"with block_size {tuple(block_size)} (expected {expected})")
    n, k = q.shape[-2:]
    s = scale_inv.float().repeat_interleave(block_size[0], dim=-2)[..., :n, :]
    s = s.repeat_interleave(block_size[1], dim=-1)[..., :k]
    return (q.float() * s).to(dtype)

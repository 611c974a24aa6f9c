"""The `torch.compile` (inductor) kernels for the quantisers' bulk passes (`fused='compile'`).

Only the element-wise bulk work is compiled: the per-group |max| reduction and the divide /
round / clamp / cast pass, with the eager code's formulas. The passes read the bf16/fp16/fp32
weight directly (no fp32 staging copy) and write into the caller's output. `fused.py` decides
when they run and checks them against the eager path first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

DEVICE_TYPES = ("cpu", "cuda")
_OPTIONS = {"emulate_precision_casts": True}  # keep every dtype round trip the eager code does

# Smaller weights (and size-1 dims, which dynamo specialises on) stay eager: no gain there, and
# every specialisation is a recompile.
MIN_NUMEL = 1 << 16

_lock = threading.Lock()
_kernels: dict[tuple, Callable] = {}


def supports(weight: torch.Tensor) -> bool:
    return weight.device.type in DEVICE_TYPES and hasattr(torch, "compile")


def worth_compiling(numel: int, *dims: int) -> bool:
    return numel >= MIN_NUMEL and all(d >= 2 for d in dims)


def _compiled(key: tuple, fn: Callable) -> Callable:
    with _lock:
        k = _kernels.get(key)
        if k is None:
            k = _kernels[key] = torch.compile(fn, dynamic=True, fullgraph=True, options=dict(_OPTIONS))
    return k


# --- the passes (formulas identical to the eager code's) -------------------------------------------

def _absmax_last(x: torch.Tensor) -> torch.Tensor:
    """max(|max|, |min|) over the last dim, in fp32 (exact: max/min/abs of widened values)."""
    y = x.float()
    return torch.maximum(y.amax(dim=-1).abs(), y.amin(dim=-1).abs())


# The passes write into the caller's output (a fresh result would cost page faults and a copy).
def _int_divide(x: torch.Tensor, safe: torch.Tensor, out: torch.Tensor, qmin: float, qmax: float) -> None:
    out.copy_((x.float() / safe).round().clamp(qmin, qmax).to(torch.int8))


def _int_reciprocal(x: torch.Tensor, inv: torch.Tensor, out: torch.Tensor, qmin: float, qmax: float) -> None:
    out.copy_((x.float() * inv).round().clamp(qmin, qmax).to(torch.int8))


def _int_rounded(dtype: torch.dtype, reciprocal: bool) -> Callable:
    """The int pass with the quotient rounded to `dtype` (bf16 / fp16) before the integer rounding,
    as a division in that dtype gives it (compressed-tensors' arithmetic)."""
    def fn(x: torch.Tensor, d: torch.Tensor, out: torch.Tensor, qmin: float, qmax: float) -> None:
        y = x.float() * d if reciprocal else x.float() / d
        out.copy_(y.to(dtype).float().round().clamp(qmin, qmax).to(torch.int8))
    return fn


def _e4m3_codes(y: torch.Tensor) -> torch.Tensor:
    """uint8 float8_e4m3fn codes of fp32 `y` (finite, |y| <= 448), round to nearest even: the integer
    arithmetic on the fp32 bits of `native_kernels.c`'s `e4m3`, written for what inductor's CPU code
    vectorises (torch 2.14's at::vec; the generated C++ read with TORCH_LOGS=output_code):

    - the final narrowing goes int32 -> fp32 -> uint8: at::vec has no int32 -> uint8 conversion (the
      generic one stores the vector and converts element by element), fp32 -> uint8 is vectorised;
    - no int -> fp32 bit reinterpretation: the subnormal branch adds to |y| itself, and the branch
      is chosen by a float compare. (Each reinterpretation is a store and reload; with AVX-512 GCC
      stores the vector as two halves and reloads it whole, a store-forwarding stall per vector.)

    Values 0..255 are exact in fp32, so the detour changes no code; `fused.verified` holds the pass
    to the eager cast bit for bit."""
    b = y.view(torch.int32)
    r = (b & 0x7FFFFFFF) - (120 << 23)  # |y|'s bits, exponent re-bias 127 -> 7
    normal = (r + 0x7FFFF + ((r >> 20) & 1)) >> 20  # RNE of the dropped 20 mantissa bits
    ay = y.abs()
    sub = (ay + 16384.0).view(torch.int32) - 0x46800000  # RNE(|y| * 2^9) for |y| < 2^-6
    code = torch.where(ay >= 0.015625, normal, sub) | ((b >> 24) & 0x80)
    return code.float().to(torch.uint8)


def _fp8_codes(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, fmax: float) -> None:
    out.copy_(_e4m3_codes((x.float() / scale).clamp(-fmax, fmax)))  # out: the e4m3 output viewed as uint8


def _fp8_cast(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, fmax: float) -> None:
    out.copy_((x.float() / scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn).view(torch.uint8))


def fp8_formulation(device_type: str) -> str:
    """How the compiled FP8 pass rounds to e4m3 here: 'cast' (inductor's own `.to(float8_e4m3fn)`)
    where inductor's CPU code is AVX-512, whose at::vec has a vectorised fp32 -> e4m3 conversion; else
    'codes' (`_e4m3_codes`): at::vec's AVX2 / NEON code converts element by element (a 4096x14336
    weight: ~1.2x slower than eager in all, against ~1.6x faster with the codes), while under AVX-512
    the cast is the faster of the two (~1.9x vs ~1.2x faster than eager). cuda: the codes."""
    if device_type != "cpu":
        return "codes"
    try:
        from torch._inductor import cpu_vec_isa

        return "cast" if isinstance(cpu_vec_isa.pick_vec_isa(), cpu_vec_isa.VecAVX512) else "codes"
    except Exception:  # noqa: BLE001 - inductor internals moved: the codes vectorise everywhere
        return "codes"


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The same memory as a non-view tensor: dynamo guards on a view's base (its shape, its
    strides), which would recompile for every weight a slice was taken from."""
    if t._base is None:
        return t
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.size(),
                                                              t.stride())


def absmax_last(x: torch.Tensor) -> torch.Tensor:
    return _compiled(("absmax", x.device.type), _absmax_last)(_plain(x))


def int_quantize(
    x: torch.Tensor, safe: torch.Tensor, out: torch.Tensor, qmin: float, qmax: float, reciprocal: bool,
    quotient_dtype: torch.dtype | None = None,
) -> None:
    """out = int8(clamp(round(x / safe))) (x * safe when `reciprocal`: `safe` is then 1/scale); the
    quotient first rounded to `quotient_dtype` (bf16 / fp16; None or fp32: not rounded)."""
    if quotient_dtype in (None, torch.float32):
        fn = _int_reciprocal if reciprocal else _int_divide
        key = ("int", reciprocal, x.device.type)
    else:
        fn = _int_rounded(quotient_dtype, reciprocal)
        key = ("int", reciprocal, quotient_dtype, x.device.type)
    _compiled(key, fn)(_plain(x), _plain(safe), _plain(out), qmin, qmax)


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, fmax: float,
                 formulation: str | None = None) -> None:
    """out = float8_e4m3fn(clamp(x / scale, ±fmax)) (fmax <= 448); `formulation`: 'cast' or 'codes'
    (None: `fp8_formulation`'s choice for this device; both give the same bits)."""
    how = formulation or fp8_formulation(x.device.type)
    fn = {"cast": _fp8_cast, "codes": _fp8_codes}[how]
    _compiled(("fp8", how, x.device.type), fn)(_plain(x), _plain(scale), _plain(out.view(torch.uint8)), fmax)

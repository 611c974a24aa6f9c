"""Opt-in `torch.compile` (inductor) kernels for the quantisers' two bulk passes.

Only the element-wise bulk work is compiled: the per-group |max| reduction and the
divide / round / clamp / cast pass. Scales are still computed by the eager code on the
small reduced tensors, so the formula that decides every output bit lives in one place.
The compiled passes read the bf16/fp16/fp32 weight directly (no fp32 staging copy), so
the transient memory is the reduced tensors only.

Switch: the `fused` argument of `quantize_int` / `quantize_fp8_block`, or the environment
variable `SLIME_ASCEND_QUANT_FUSED=compile` when the argument is None (default: eager).
Only for device types whose inductor backend we trust (cpu, cuda); elsewhere (npu, ...)
the eager path runs. On first use per (kernel, weight dtype, device type) the fused path
quantises a probe tensor (exact .5 ties, near ties, zeros, -0.0, subnormals, ±max, odd
shapes) both ways; any bit difference or compile error disables it for that key with
one warning, and the eager path is used from then on.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable

import torch

ENV_VAR = "SLIME_ASCEND_QUANT_FUSED"
FUSED_DEVICE_TYPES = ("cpu", "cuda")
_OPTIONS = {"emulate_precision_casts": True}  # keep every dtype round trip the eager code does

# Smaller weights (and size-1 dims, which dynamo specialises on) stay eager: no gain there, and
# every specialisation is a recompile.
MIN_FUSED_NUMEL = 1 << 16

_lock = threading.Lock()
_kernels: dict[tuple, Callable] = {}
_verdict: dict[tuple, bool] = {}


def fused_requested(fused: bool | None) -> bool:
    """The argument if given, else the environment switch (`compile` / `1` / `on`)."""
    if fused is not None:
        return bool(fused)
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "0", "off", "eager", "false", "no"):
        return False
    if value in ("compile", "1", "on", "true", "yes"):
        return True
    raise ValueError(f"{ENV_VAR}={value!r}: use 'compile' to enable the fused path or 'off'")


def fused_supported(device: torch.device) -> bool:
    return device.type in FUSED_DEVICE_TYPES and hasattr(torch, "compile")


def _compiled(key: tuple, fn: Callable) -> Callable:
    with _lock:
        k = _kernels.get(key)
        if k is None:
            k = _kernels[key] = torch.compile(fn, dynamic=True, fullgraph=True, options=dict(_OPTIONS))
    return k


# --- the compiled passes (formulas identical to the eager code's) -------------------------------

def _absmax_last(x: torch.Tensor) -> torch.Tensor:
    """max(|max|, |min|) over the last dim, in fp32 (exact: max/min/abs of widened values)."""
    y = x.float()
    return torch.maximum(y.amax(dim=-1).abs(), y.amin(dim=-1).abs())


# The passes write into the caller's output (a fresh result would cost page faults and a copy).
def _int_divide(x: torch.Tensor, safe: torch.Tensor, out: torch.Tensor, qmin: float, qmax: float) -> None:
    out.copy_((x.float() / safe).round().clamp(qmin, qmax).to(torch.int8))


def _int_reciprocal(x: torch.Tensor, inv: torch.Tensor, out: torch.Tensor, qmin: float, qmax: float) -> None:
    out.copy_((x.float() * inv).round().clamp(qmin, qmax).to(torch.int8))


def _fp8_divide(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, fmax: float) -> None:
    out.copy_((x.float() / scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn))


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
) -> None:
    """out = int8(clamp(round(x / safe))) (x * safe when `reciprocal`: `safe` is then 1/scale)."""
    fn = _int_reciprocal if reciprocal else _int_divide
    _compiled(("int", reciprocal, x.device.type), fn)(_plain(x), _plain(safe), _plain(out), qmin, qmax)


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, fmax: float) -> None:
    """out = float8_e4m3fn(clamp(x / scale, ±fmax))."""
    _compiled(("fp8", x.device.type), _fp8_divide)(_plain(x), _plain(scale), _plain(out), fmax)


# --- first-use self-check -----------------------------------------------------------------------

def verified(key: tuple, check: Callable[[], bool]) -> bool:
    """Run `check` (fused == eager on a probe) once per key; False (with one warning) on a
    difference or an error."""
    with _lock:
        if key in _verdict:
            return _verdict[key]
    try:
        ok = bool(check())
        why = "its output differs from the eager path on the probe tensor"
    except Exception as e:  # noqa: BLE001 - any compile/runtime failure means: use eager
        ok, why = False, f"{type(e).__name__}: {e}"
    with _lock:
        if key not in _verdict:
            _verdict[key] = ok
            if not ok:
                warnings.warn(f"slime_ascend.quant: fused (torch.compile) quantisation disabled for {key}: {why}; "
                              f"using the eager path", RuntimeWarning, stacklevel=3)
        return _verdict[key]


def verdict(key: tuple) -> bool | None:
    """The self-check's verdict for `key` (None: not checked yet)."""
    with _lock:
        return _verdict.get(key)


def eligible(numel: int, *dims: int) -> bool:
    return numel >= MIN_FUSED_NUMEL and all(d >= 2 for d in dims)


def disable(key: tuple, error: BaseException) -> None:
    """A fused call failed after its self-check passed (e.g. a recompile limit): eager from now on."""
    with _lock:
        first = _verdict.get(key, True)
        _verdict[key] = False
    if first:
        warnings.warn(f"slime_ascend.quant: fused (torch.compile) quantisation disabled for {key}: "
                      f"{type(error).__name__}: {error}; using the eager path", RuntimeWarning, stacklevel=3)


def reset() -> None:
    """Forget the self-check verdicts (tests); compiled kernels are kept."""
    with _lock:
        _verdict.clear()


def probe_weight(dtype: torch.dtype, device: torch.device, rows: int = 133, cols: int = 389) -> torch.Tensor:
    """A deterministic [rows, cols] weight exercising the corner cases of both formats.

    Row r mixes: uniform-over-bit-pattern values (every binade, subnormals included),
    exact .5 ties of a power-of-two scale (127·2^e row max; j+0.5 multiples), all-zero
    and -0.0 rows, ±finfo.max rows, single-nonzero rows, and dense rows of consecutive
    representable values near a non-power-of-two scale (near ties).
    """
    g = torch.Generator().manual_seed(1234)
    info = torch.finfo(dtype)
    out = torch.randn(rows, cols, generator=g, dtype=torch.float32)
    if dtype in (torch.bfloat16, torch.float16):
        bits = torch.randint(-(1 << 15), 1 << 15, (rows, cols), generator=g, dtype=torch.int32).to(torch.int16)
        rnd = bits.view(dtype).float()
    else:
        bits = torch.randint(-(1 << 31), (1 << 31) - 1, (rows, cols), generator=g, dtype=torch.int64).to(torch.int32)
        rnd = bits.view(torch.float32)
    rnd = torch.where(torch.isfinite(rnd), rnd, torch.zeros(()))
    for r in range(rows):
        kind = r % 9
        if kind == 0:
            out[r] = rnd[r]
        elif kind == 1:  # exact ties: scale 2^e after any divisor in {127, 127.5, 7, 7.5, 448}
            e = float(2.0 ** (r % 11 - 5))
            j = torch.randint(-127, 127, (cols,), generator=g).float() + 0.5
            out[r] = j * e
            out[r, 0] = 127 * e
        elif kind == 2:
            out[r] = 0.0 if r % 2 else -0.0
        elif kind == 3:
            out[r] = torch.where(torch.rand(cols, generator=g) < 0.5, info.max, -info.max)
        elif kind == 4:
            out[r] = 0.0
            out[r, r % cols] = float(torch.randn((), generator=g))
        elif kind == 5:  # consecutive representable values around a random magnitude: near ties
            base = torch.tensor(float(torch.rand((), generator=g)) * 3 + 0.01, dtype=dtype)
            step = torch.arange(cols, dtype=torch.int32) - cols // 2
            if dtype in (torch.bfloat16, torch.float16):
                v = (base.view(torch.int16).int() + step).to(torch.int16).view(dtype).float()
            else:
                v = (base.view(torch.int32) + step * 4099).view(torch.float32)
            out[r] = v
        elif kind == 6:  # subnormal / tiny rows
            out[r] = rnd[r] * float(info.tiny) * 2.0 ** -3
        elif kind == 7:
            out[r] = torch.randn(cols, generator=g) * 10.0 ** float(r % 7 - 3)
        else:
            out[r] = torch.randn(cols, generator=g).round() * 0.5  # halves: ties for unit scales
    return out.to(dtype).to(device)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (tells -0.0 from 0.0 and compares NaN payloads)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def near_ties(
    dtype: torch.dtype, device: torch.device, scale_of: Callable[[torch.Tensor], torch.Tensor],
    cast: Callable[[torch.Tensor], torch.Tensor], groups: int = 64, width: int = 32,
) -> torch.Tensor:
    """[groups, width] rows: row i holds a group max A_i (first) and values x <= A_i for which
    cast(x / s) != cast(x * (1 / s)), s = scale_of(A_i), found by enumerating every bf16/fp16 value
    up to A_i; rows are padded with A_i's own ties-free values. Empty for fp32 weights."""
    if dtype not in (torch.bfloat16, torch.float16):
        return torch.zeros(0, width, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(99)
    finite = (1 << 15) - (1 << (15 - (8 if dtype == torch.bfloat16 else 5))) - 1  # below +inf's pattern
    values = torch.arange(1, finite, dtype=torch.int32).to(torch.int16).view(dtype).float()
    lo, hi = int((values < 1e-3).sum()), int((values < 1e3).sum())
    rows = []
    for idx in torch.randint(lo, hi, (groups * 4,), generator=g).tolist():
        a = values[idx]
        x = values[: idx + 1]
        s = scale_of(a.reshape(1)).reshape(())
        hits = x[cast(x / s) != cast(x * torch.reciprocal(s))]
        if hits.numel():
            row = torch.cat([a.reshape(1), hits[: width - 1]])
            row = torch.cat([row, -row, row])[:width] if row.numel() < width else row
            rows.append(torch.nn.functional.pad(row, (0, width - row.numel())))
        if len(rows) == groups:
            break
    if not rows:
        return torch.zeros(0, width, dtype=dtype, device=device)
    return torch.stack(rows).to(dtype).to(device)

"""Which kernels run the quantisers' bulk passes, and the machinery that keeps them honest.

The bulk work of a quantiser is two passes over the weight: the per-group |max| reduction and
the divide / round / clamp / cast pass. The scales in between are computed by the eager code on
the small reduced tensors (the native FP8 kernel, a single pass, applies FP8's one-line rule
itself). Three ways to run the bulk passes:

- ``eager``: plain torch ops in row chunks (any device; the reference).
- ``native``: the C kernels of `native.py` (CPU only; vectorised sweeps on torch's OpenMP pool).
  The default on CPU when they build.
- ``compile``: the `torch.compile` (inductor) kernels of `compiled.py` (cpu / cuda).

Switch: the `fused` argument of `quantize_int` / `quantize_fp8_block` (False: eager, True:
``auto``, or one of ``auto`` / ``native`` / ``compile`` / ``off``), or when it is None the
environment variable `SLIME_ASCEND_QUANT_FUSED` (same words; unset means ``auto``). ``auto``
picks ``native`` for CPU weights when the kernels build and are not slower than eager on this
machine, else eager; accelerators (npu, cuda) stay eager unless ``compile`` is asked for.

``auto``'s timing (`faster_than_eager`): on first use per (kernel, scheme, weight dtype, device
type, torch threads) both paths quantise a calibration weight (512 x 4096, a few ms each),
interleaved, best of five; the native path is kept when it is not slower. The choice is cached
in the process and on disk beside the compiled kernel library (`native.stored_choice`), so later
processes on the same machine and build reuse it. Both paths give the same bits, so the choice
changes only the speed. On first use per (kernel, backend, scheme, weight
dtype, device type) the fast path quantises probe tensors (exact .5 ties, near ties, zeros,
-0.0, subnormals, ±max, odd shapes) both ways; any bit difference or error disables it for
that key with one warning, and the eager path is used from then on.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable

import torch

from . import compiled as _compiled
from . import native as _native

ENV_VAR = "SLIME_ASCEND_QUANT_FUSED"
CHOICES = ("auto", "native", "compile", "off")
_OFF = ("0", "off", "eager", "false", "no")
_lock = threading.Lock()
_verdict: dict[tuple, bool] = {}
_auto: dict[tuple, bool] = {}  # auto's timed choice: True = the fast path, False = eager
_warned_unavailable = False
CALIBRATION_SHAPE = (512, 4096)
CALIBRATION_REPEATS = 5


def requested(fused: bool | str | None) -> str:
    """The user's choice as one of CHOICES: the argument if given, else the environment switch."""
    if isinstance(fused, bool):
        return "auto" if fused else "off"
    source = "fused" if fused is not None else ENV_VAR
    value = (fused if fused is not None else os.environ.get(ENV_VAR, "auto")).strip().lower() or "auto"
    if value in _OFF:
        return "off"
    if value in ("1", "on", "true", "yes"):
        return "auto"
    if value not in CHOICES:
        raise ValueError(f"{source}={value!r}: use one of {', '.join(CHOICES)} (auto: native kernels on CPU, "
                         f"eager elsewhere)")
    return value


def backend(fused: bool | str | None, weight: torch.Tensor) -> str | None:
    """The backend that will run `weight`'s bulk passes: 'native', 'compile' or None (eager)."""
    choice = requested(fused)
    if choice == "compile":
        return "compile" if _compiled.supports(weight) else None
    if choice in ("auto", "native") and _native.supports(weight):
        if _native.available():
            return "native"
        if choice == "native":
            _warn_native_unavailable()
    return None


def _warn_native_unavailable() -> None:
    global _warned_unavailable
    with _lock:
        first, _warned_unavailable = not _warned_unavailable, True
    if first:
        warnings.warn(f"slime_ascend.quant: native kernels unavailable ({_native.unavailable_reason()}); using the "
                      f"eager path", RuntimeWarning, stacklevel=4)


def eligible(kind: str, numel: int, *dims: int) -> bool:
    """Worth a compiled kernel (`compile` only; native kernels take every shape)."""
    return kind != "compile" or _compiled.worth_compiling(numel, *dims)


# --- first-use self-check -----------------------------------------------------------------------

def verified(key: tuple, check: Callable[[], bool]) -> bool:
    """Run `check` (fast path == eager on a probe) once per key; False (with one warning) on a
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
                warnings.warn(f"slime_ascend.quant: fused ({key[1]}) quantisation disabled for {key}: {why}; "
                              f"using the eager path", RuntimeWarning, stacklevel=3)
        return _verdict[key]


def verdict(key: tuple) -> bool | None:
    """The self-check's verdict for `key` (None: not checked yet)."""
    with _lock:
        return _verdict.get(key)


def disable(key: tuple, error: BaseException) -> None:
    """A fast-path call failed after its self-check passed (e.g. a recompile limit): eager from now on."""
    with _lock:
        first = _verdict.get(key, True)
        _verdict[key] = False
    if first:
        warnings.warn(f"slime_ascend.quant: fused ({key[1]}) quantisation disabled for {key}: "
                      f"{type(error).__name__}: {error}; using the eager path", RuntimeWarning, stacklevel=3)


def reset() -> None:
    """Forget the self-check verdicts, auto's in-process choices and the unavailability warning
    (tests); kernels and the choices stored beside them are kept."""
    global _warned_unavailable
    with _lock:
        _verdict.clear()
        _auto.clear()
        _warned_unavailable = False


# --- auto: the fast path only where it is not slower than eager -----------------------------------

def calibration_weight(dtype: torch.dtype, device: torch.device, multiple: int = 1) -> torch.Tensor:
    """The weight `auto` times both paths on: CALIBRATION_SHAPE (columns rounded up to a `multiple`,
    e.g. a group size), N(0, 0.02) like a trained layer."""
    g = torch.Generator().manual_seed(7)
    rows, cols = CALIBRATION_SHAPE
    return torch.randn(rows, -(-cols // multiple) * multiple, generator=g).mul_(0.02).to(dtype).to(device)


def _auto_key(key: tuple) -> tuple:
    return (*key, torch.get_num_threads())


def _best_times(fast: Callable[[], object], eager: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Best-of-`repeats` seconds of each, interleaved (a load spike hits both), after one warm-up."""
    fast(), eager()
    tf = te = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fast()
        t1 = time.perf_counter()
        eager()
        t2 = time.perf_counter()
        tf, te = min(tf, t1 - t0), min(te, t2 - t1)
    return tf, te


def faster_than_eager(key: tuple, setup: Callable[[], tuple[Callable[[], object], Callable[[], object]]]) -> bool:
    """`auto`'s choice for `key` (a self-check key) on this machine: True when the fast path ran no
    slower than eager on the calibration weight; `setup()` gives the two calls (fast, eager). Timed
    once per key and torch thread count, then cached in this process and beside the kernel library;
    an error while timing means eager in this process."""
    k = _auto_key(key)
    with _lock:
        if k in _auto:
            return _auto[k]
    choice = _native.stored_choice(repr(k)) if key[1] == "native" else None
    if choice is None:
        try:
            tf, te = _best_times(*setup(), CALIBRATION_REPEATS)
            choice = tf <= te
        except Exception:  # noqa: BLE001 - eager in this process (not stored: a later process times again)
            tf = te = None
            choice = False
        if key[1] == "native" and tf is not None:
            _native.store_choice(repr(k), choice, {"fast_ms": round(tf * 1e3, 3), "eager_ms": round(te * 1e3, 3),
                                                   "shape": list(CALIBRATION_SHAPE)})
    with _lock:
        _auto.setdefault(k, choice)
        return _auto[k]


def auto_choice(key: tuple) -> bool | None:
    """auto's cached choice for `key` at the current thread count (None: not timed yet)."""
    with _lock:
        return _auto.get(_auto_key(key))


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

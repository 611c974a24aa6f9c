"""Shared helpers: argument checks and row-chunk sizing."""

from __future__ import annotations

import torch

# Transient fp32 staging per chunk (elements). 2^20 fp32 = 4 MiB: stays in cache on CPU and
# bounds the extra memory on accelerators regardless of the weight's size.
DEFAULT_CHUNK_ELEMS = 1 << 20


def check_float_weight(weight: torch.Tensor, name: str, ndims: tuple[int, ...] = (2, 3)) -> None:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(weight).__name__}")
    if not weight.is_floating_point() or weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{name}: expected a bf16/fp16/fp32 weight, got dtype {weight.dtype}")
    if weight.dim() not in ndims:
        raise ValueError(f"{name}: expected a tensor with {' or '.join(map(str, ndims))} dims, got shape "
                         f"{tuple(weight.shape)}")


def raise_if_not_finite(ok: torch.Tensor | bool, name: str, what: str = "weight",
                        action: str = "quantise it") -> None:
    """`ok` is a 0-d bool tensor accumulated over chunks (one host sync per tensor)."""
    if not bool(ok):
        raise ValueError(f"{name}: {what} contains NaN or inf; refusing to {action} "
                         f"(fix the checkpoint / training step that produced it)")


def all_finite(t: torch.Tensor, chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> bool:
    """True when a tensor has no NaN/inf (non-float tensors always pass); checked in chunks so a
    large embedding never needs a full-size bool temporary."""
    if not t.is_floating_point():
        return True
    flat = t.reshape(-1)
    ok = torch.ones((), dtype=torch.bool, device=t.device)
    for i in range(0, flat.numel(), chunk_elems):
        part = flat[i:i + chunk_elems]
        if part.element_size() == 1:  # float8: isfinite needs a wider dtype on some backends
            part = part.float()
        ok &= torch.isfinite(part).all()
    return bool(ok)


def rows_per_chunk(cols: int, chunk_elems: int, multiple: int = 1) -> int:
    rows = max(1, chunk_elems // max(1, cols))
    rows = max(multiple, rows // multiple * multiple)
    return rows


def clamp_is_noop(tmax: torch.Tensor, limit: float) -> bool:
    """True when max(tmax) <= limit, i.e. a clamp to +-limit of values bounded by tmax changes nothing.

    Decided on the host only for CPU tensors (free there); elsewhere it returns False so the
    clamp always runs (no device sync per chunk). The result is the same either way."""
    if tmax.device.type != "cpu" or tmax.numel() == 0:
        return False
    return bool(tmax.max() <= limit)  # NaN -> False


def check_out(t: torch.Tensor, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, what: str) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous {dtype} tensor of shape {tuple(shape)}, "
                         f"got {t.dtype} {tuple(t.shape)}")

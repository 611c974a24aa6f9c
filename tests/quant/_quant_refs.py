"""Slow, obviously right references shared by the quantisation tests."""

from __future__ import annotations

import math

import torch

FP8 = torch.float8_e4m3fn


def fp8_block_reference(w: torch.Tensor, bn: int = 128, bk: int = 128, fmax: float = 448.0, floor: float = 1e-12):
    """The DeepSeek FP8 block formula, block by block: s = max(amax, floor) / fmax in fp32 (the floor
    handles all-zero blocks), q = clamp(x / s, ±fmax) cast to e4m3. DeepSeek's own formula has no
    clamp; with fmax = 448 it changes no bit (|x / s| <= 448 (1 + 2^-23) casts to 448 either way)."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=FP8)
    s = torch.empty(math.ceil(n / bn), math.ceil(k / bk), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            sc = torch.tensor(max(float(blk.abs().max()), floor), dtype=torch.float32) / fmax
            s[i, j] = sc
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk / sc).clamp(-fmax, fmax).to(FP8)
    return q, s


def expand_blocks(t: torch.Tensor, rows: int, cols: int, bn: int, bk: int) -> torch.Tensor:
    """Per-block values [ceil(rows/bn), ceil(cols/bk)] repeated to every element of a [rows, cols] matrix."""
    return t.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]

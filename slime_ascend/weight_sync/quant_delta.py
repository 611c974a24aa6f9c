"""Delta of two quantised weight versions: only the changed blocks of bytes, applied into a copy.

After a small training step most quantised values (and most scales) do not change. :func:`block_delta`
compares two versions tensor by tensor (same names, e.g. what ``slime-ascend quantize`` or a sync plugin
produces) in blocks of ``block_bytes`` bytes of each tensor's storage and keeps the indices and bytes of
the blocks that differ; a tensor that is new, or whose dtype or shape changed, is sent whole. With
``block_bytes`` 32 an MXFP8 weight's blocks are exactly its OCP blocks (32 e4m3 values), and its
``weight_scale`` (one byte per block) is diffed the same way, so a changed block travels with its scale
whenever the scale changed. :func:`apply_delta` rebuilds the new version from the old one and the delta
into new tensors (the old version is left as it was, so an engine can switch to the result atomically);
the result is byte-identical to the new version by construction (``tests/weight_sync/test_quant_delta.py``).

Pure torch; no transport here (a delta is a few tensors per name, which any transport carries).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


@dataclass
class TensorDelta:
    dtype: torch.dtype
    shape: tuple[int, ...]
    index: torch.Tensor | None  # int64 block indices; None: `payload` is the whole tensor
    payload: torch.Tensor  # uint8 [len(index), block_bytes] (the last block zero-padded), or the whole tensor


@dataclass
class Delta:
    block_bytes: int
    tensors: dict[str, TensorDelta] = field(default_factory=dict)
    total_bytes: int = 0  # bytes of the new version

    @property
    def payload_bytes(self) -> int:
        return sum(d.payload.numel() * d.payload.element_size() + (0 if d.index is None else d.index.numel() * 8)
                   for d in self.tensors.values())

    @property
    def density(self) -> float:
        """Bytes a delta push carries (payload and indices) over the bytes of a full push."""
        return self.payload_bytes / max(1, self.total_bytes)


def _blocks(t: torch.Tensor, block_bytes: int) -> torch.Tensor:
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-raw.numel()) % block_bytes
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(-1, block_bytes)


def block_delta(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], block_bytes: int = 32) -> Delta:
    """The blocks of `new` that differ from `old` (names of `old` that `new` lacks are not carried)."""
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be a positive int, got {block_bytes}")
    delta = Delta(block_bytes)
    for name, t in new.items():
        delta.total_bytes += t.numel() * t.element_size()
        prev = old.get(name)
        if prev is None or prev.dtype != t.dtype or tuple(prev.shape) != tuple(t.shape):
            delta.tensors[name] = TensorDelta(t.dtype, tuple(t.shape), None, t.detach().contiguous().clone())
            continue
        a, b = _blocks(prev, block_bytes), _blocks(t, block_bytes)
        index = (a != b).any(dim=1).nonzero().view(-1)
        if index.numel():
            delta.tensors[name] = TensorDelta(t.dtype, tuple(t.shape), index, b.index_select(0, index))
    return delta


def apply_delta(old: Mapping[str, torch.Tensor], delta: Delta) -> dict[str, torch.Tensor]:
    """The new version: `old`'s tensors with `delta`'s blocks written over them, in new tensors."""
    out: dict[str, torch.Tensor] = {}
    for name, t in old.items():
        d = delta.tensors.get(name)
        if d is None:
            out[name] = t
        elif d.index is None:
            out[name] = d.payload
        else:
            if t.dtype != d.dtype or tuple(t.shape) != d.shape:
                raise ValueError(f"{name}: delta is for {d.dtype} {d.shape}, the old version holds {t.dtype} "
                                 f"{tuple(t.shape)}; push this version whole")
            blocks = _blocks(t, delta.block_bytes).clone()
            blocks.index_copy_(0, d.index, d.payload)
            nbytes = t.numel() * t.element_size()
            out[name] = blocks.view(-1)[:nbytes].view(d.dtype).view(d.shape)
    for name, d in delta.tensors.items():
        if name not in old:
            if d.index is not None:
                raise ValueError(f"{name}: delta has blocks of a tensor the old version lacks; push it whole")
            out[name] = d.payload
    return out

"""A teacher checkpoint directory of ``*.safetensors`` files: list it, check it cheaply, read it into host memory.

Read with ``safetensors`` only (never pickle).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["safetensors_files", "tensor_layout", "validate_safetensors_dir", "read_safetensors_dir"]


def safetensors_files(ckpt_dir: Path | str) -> list[Path]:
    """Sorted ``*.safetensors`` files of a checkpoint directory; ``ValueError`` naming the first one that is not
    a regular file (a FIFO would block the reader for ever, a device would be read without end)."""
    from ..files import regular_files

    return regular_files(ckpt_dir, "*.safetensors")


def validate_safetensors_dir(ckpt_dir: Path | str) -> int:
    """Cheap integrity check (directory, files, headers, sizes); returns total tensor bytes.

    Raises ``FileNotFoundError`` / ``ValueError`` describing the first problem.
    """
    from safetensors import safe_open

    d = Path(ckpt_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"checkpoint directory does not exist: {d}")
    files = safetensors_files(d)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {d}")
    total = 0
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for k in sf.keys():
                    sl = sf.get_slice(k)
                    total += math.prod(sl.get_shape()) * _DTYPE_BYTES.get(sl.get_dtype(), 4)
        except Exception as e:  # SafetensorError is not exported as a stable type
            raise ValueError(f"corrupt safetensors file {f}: {e}") from e
    return total


def tensor_layout(ckpt_dir: Path | str) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, from the files' headers (no tensor data is read)."""
    from safetensors import safe_open

    layout: dict[str, tuple[int, ...]] = {}
    for f in safetensors_files(ckpt_dir):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for k in sf.keys():
                layout[k] = tuple(sf.get_slice(k).get_shape())
    return layout


_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def read_safetensors_dir(
    ckpt_dir: Path | str,
    *,
    pin_memory: bool = False,
    share_memory: bool = False,
    key_map: Callable[[str], str | None] | None = None,
) -> tuple[dict[str, torch.Tensor], int]:
    """Read every tensor of a checkpoint directory into fresh host memory.

    The data is copied out of safetensors' memory map into newly allocated (pinned when
    ``pin_memory``; in shared memory, as torch's sharing strategy makes it, when ``share_memory``) tensors, so
    the returned dict is fully resident and independent of the file.
    ``key_map`` renames keys (return None to skip one). Returns ``(state, total_bytes)``.
    """
    from safetensors import safe_open

    files = safetensors_files(ckpt_dir)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {ckpt_dir}")
    state: dict[str, torch.Tensor] = {}
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for k in sf.keys():
                name = key_map(k) if key_map is not None else k
                if name is None:
                    continue
                if name in state:
                    raise ValueError(f"duplicate tensor {name!r} in {f}")
                src = sf.get_tensor(k)  # lazily mmapped; force the read with an explicit copy
                dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin_memory)
                if share_memory:
                    dst.share_memory_()
                dst.copy_(src)
                del src
                state[name] = dst
                total += dst.numel() * dst.element_size()
    return state, total

"""Which ops stand in for the CUDA-only kernel modules of slime's GLM-5 spec, per device.

slime's wrappers (``slime_plugins/models/glm5/ops/indexer.py``, ``sparse_mla.py``) import four tilelang
modules; patch ``train.glm5_kernels`` puts modules of the same names and functions in their place where they
cannot run. This module decides what those functions are (no slime import):

=====================  ===========================================================================================
device                 ops
=====================  ===========================================================================================
``cuda`` (or ROCm)     none: slime's own tilelang kernels stay (:func:`device_neutral_ops_wanted` is False)
``cpu``                the torch ops of :mod:`slime_ascend.glm5.ops`
``npu`` (torch_npu)    the sparse-MLA forward through ``torch_npu.npu_sparse_flash_attention`` where the installed
                       torch_npu has it with the parameters of :data:`NPU_SPARSE_ATTENTION_PARAMS` (read from the
                       op's schema: torch_npu exposes it as a ``torch.ops.npu`` OpOverloadPacket, whose Python
                       signature is ``(*args, **kwargs)``) and a call fits the op (:mod:`.npu_sparse_attention`),
                       logged once either way; everything else the torch
                       ops. torch_npu's ``npu_lightning_indexer`` returns the top-k indices, not the ``[T, T_kv]``
                       logits slime's ``IndexerFunction`` gathers its scores from and differentiates, so the indexer
                       stays torch's (and selects by the ``dsa-determinism`` rule), as do both backwards.
=====================  ===========================================================================================
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
from collections.abc import Callable
from types import ModuleType

__all__ = ["KERNEL_MODULES", "NPU_SPARSE_ATTENTION_PARAMS", "device_kind", "device_neutral_ops_wanted",
           "kernel_functions", "npu_sparse_attention_op", "param_names"]

logger = logging.getLogger("slime_ascend.glm5")
_LOGGED: set[str] = set()

#: slime's tilelang module (under ``slime_plugins.models.glm5.ops``) -> the names its wrappers import from it.
KERNEL_MODULES: dict[str, tuple[str, ...]] = {
    "tilelang_indexer_fwd": ("indexer_fwd_interface",),
    "tilelang_indexer_bwd": ("indexer_bwd_interface",),
    "tilelang_sparse_mla_fwd": ("sparse_mla_fwd_interface",),
    "tilelang_sparse_mla_bwd": ("sparse_mla_bwd",),
}

#: The parameters :mod:`.npu_sparse_attention` passes to ``torch_npu.npu_sparse_flash_attention`` (op-plugin's schema,
#: ``op_plugin_functions.yaml``: ``(query, key, value, sparse_indices, scale_value, *, block_table,
#: actual_seq_lengths_query, actual_seq_lengths_kv, query_rope, key_rope, sparse_block_size, layout_query, layout_kv,
#: sparse_mode, pre_tokens, next_tokens, attention_mode, return_softmax_lse, sinks)``).
NPU_SPARSE_ATTENTION_PARAMS = ("query", "key", "value", "sparse_indices", "scale_value", "actual_seq_lengths_query",
                               "actual_seq_lengths_kv", "query_rope", "key_rope", "sparse_block_size", "layout_query",
                               "layout_kv", "sparse_mode", "attention_mode", "return_softmax_lse")


def device_kind() -> str:
    """``cuda`` where slime's CUDA kernels can run (a CUDA or ROCm build of torch with a device), ``npu`` where
    torch_npu is installed, else ``cpu``."""
    import torch

    if (torch.version.cuda or getattr(torch.version, "hip", None)) and torch.cuda.is_available():
        return "cuda"
    try:
        if importlib.util.find_spec("torch_npu") is not None:
            return "npu"
    except (ImportError, ValueError):
        pass
    return "cpu"


def device_neutral_ops_wanted() -> bool:
    """Condition of the glm5 patches: the accelerator is not CUDA (slime's kernels and TE stay on CUDA)."""
    return device_kind() != "cuda"


def param_names(fn: Callable) -> tuple[str, ...] | None:
    """The parameter names of ``fn``: from a torch op's schema (an OpOverload's ``_schema``, an
    OpOverloadPacket's ``default`` overload), else from its Python signature; None when neither can be read.
    The schema comes first: a ``torch.ops`` op's Python signature is ``(*args, **kwargs)``."""
    for holder in (fn, getattr(fn, "default", None)):
        schema = getattr(holder, "_schema", None)
        if schema is not None and hasattr(schema, "arguments"):
            return tuple(a.name for a in schema.arguments)
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.info(message)


def npu_sparse_attention_op(torch_npu: ModuleType | None) -> Callable | None:
    """``torch_npu.npu_sparse_flash_attention`` when ``torch_npu`` has it with every parameter of
    :data:`NPU_SPARSE_ATTENTION_PARAMS`, else None; logs (once per outcome) which sparse-MLA forward GLM-5
    training takes and why."""
    op = getattr(torch_npu, "npu_sparse_flash_attention", None) if torch_npu is not None else None
    if op is None:
        _log_once("GLM-5 sparse-MLA forward: the torch op (torch_npu has no npu_sparse_flash_attention)")
        return None
    names = param_names(op)
    missing = [p for p in NPU_SPARSE_ATTENTION_PARAMS if names is None or p not in names]
    if missing:
        _log_once("GLM-5 sparse-MLA forward: the torch op (this torch_npu's npu_sparse_flash_attention lacks "
                  f"{', '.join(missing)}: an older op without MLA-absorb)")
        return None
    _log_once("GLM-5 sparse-MLA forward: torch_npu.npu_sparse_flash_attention (MLA-absorb, TND), where a call "
              "fits the op's limits; the torch op otherwise")
    return op


def kernel_functions(device: str | None = None, torch_npu: ModuleType | None = None) -> dict[str, dict[str, Callable]]:
    """For each module of :data:`KERNEL_MODULES`, its names -> the functions that stand in for them on ``device``
    (default :func:`device_kind`). ``torch_npu``: the module to take NPU ops from (default: imported on ``npu``).
    ValueError on ``cuda``: slime's kernels run there."""
    from . import ops

    device = device_kind() if device is None else device
    if device == "cuda":
        raise ValueError("device 'cuda' runs slime's own tilelang kernels: no stand-ins are selected there")
    if device not in ("cpu", "npu"):
        raise ValueError(f"device {device!r}: expected 'cpu' or 'npu'")
    functions = {module: {name: getattr(ops, name) for name in names} for module, names in KERNEL_MODULES.items()}
    if device == "npu":
        if torch_npu is None:
            torch_npu = importlib.import_module("torch_npu")
        op = npu_sparse_attention_op(torch_npu)
        if op is not None:
            from .npu_sparse_attention import make_sparse_mla_fwd_interface

            functions["tilelang_sparse_mla_fwd"]["sparse_mla_fwd_interface"] = make_sparse_mla_fwd_interface(op)
    return functions

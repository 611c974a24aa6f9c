"""Device-neutral GLM-5 ops: plain-torch counterparts of the CUDA-only ops of slime's GLM-5 spec.

Pure (tensors in, tensors out; no slime, Megatron or Ray import). Each function has the name, arguments
and defaults of the slime (or apex) function it stands for, so a patch can put it in place of the CUDA one
without editing slime; :data:`SLIME_COUNTERPARTS` lists them (``module:attribute`` of the CUDA original ->
ours), and ``tests/glm5`` checks the signatures against slime's source.

* :mod:`.indexer` -- lightning indexer scores, the ``dsa-determinism`` top-k, its autograd function;
* :mod:`.sparse_mla` -- sparse MLA attention over the selected keys, forward and backward;
* :mod:`.rope` -- apex's THD RoPE.
"""

from __future__ import annotations

from .indexer import (
    IndexerFunction,
    generate_varlen_mask_params,
    indexer_bwd_interface,
    indexer_fwd_interface,
    lighting_indexer,
    pytorch_extract_topk_scores,
    pytorch_topk_with_invalid_padding,
)
from .rope import fused_apply_rotary_pos_emb_thd
from .sparse_mla import SparseMLA, sparse_mla_bwd, sparse_mla_fwd_interface

_OPS = "slime_plugins.models.glm5.ops."

#: ``"module:attribute"`` of each CUDA-only original -> the torch op with its interface.
SLIME_COUNTERPARTS = {
    _OPS + "tilelang_indexer_fwd:indexer_fwd_interface": indexer_fwd_interface,
    _OPS + "tilelang_indexer_bwd:indexer_bwd_interface": indexer_bwd_interface,
    _OPS + "tilelang_sparse_mla_fwd:sparse_mla_fwd_interface": sparse_mla_fwd_interface,
    _OPS + "tilelang_sparse_mla_bwd:sparse_mla_bwd": sparse_mla_bwd,
    _OPS + "indexer:pytorch_extract_topk_scores": pytorch_extract_topk_scores,
    _OPS + "indexer:pytorch_topk_with_invalid_padding": pytorch_topk_with_invalid_padding,
    _OPS + "indexer:IndexerFunction": IndexerFunction,
    _OPS + "indexer:lighting_indexer": lighting_indexer,
    _OPS + "indexer:generate_varlen_mask_params": generate_varlen_mask_params,
    _OPS + "sparse_mla:SparseMLA": SparseMLA,
    "apex.transformer.functional:fused_apply_rotary_pos_emb_thd": fused_apply_rotary_pos_emb_thd,
}

__all__ = [
    "SLIME_COUNTERPARTS",
    "IndexerFunction",
    "SparseMLA",
    "fused_apply_rotary_pos_emb_thd",
    "generate_varlen_mask_params",
    "indexer_bwd_interface",
    "indexer_fwd_interface",
    "lighting_indexer",
    "pytorch_extract_topk_scores",
    "pytorch_topk_with_invalid_padding",
    "sparse_mla_bwd",
    "sparse_mla_fwd_interface",
]

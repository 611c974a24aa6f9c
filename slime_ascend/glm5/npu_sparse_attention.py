"""slime's sparse-MLA forward interface over torch_npu's fused ``npu_sparse_flash_attention`` (Ascend).

``make_sparse_mla_fwd_interface(op)`` returns a function with the interface of slime's
``tilelang_sparse_mla_fwd.sparse_mla_fwd_interface`` (:func:`slime_ascend.glm5.ops.sparse_mla_fwd_interface`). A
call goes to the fused op when it fits the op's documented limits, else to the torch op:

* one latent KV head (``kv`` [T_kv, 1, 576]), queries [T, H, 576] with H in 1, 2, 4, ..., 128, the value the
  first ``d_v = 512`` dims and the last 64 the RoPE part (the op's ``attention_mode=2``, MLA-absorb:
  ``query_rope`` / ``key_rope``), bf16 or fp16;
* the packed micro-batch is passed as one ``TND`` sequence of length T (slime's indices are positions in the
  packed stream and never point past their query, so ``sparse_mode=3``'s causal limit holds), indices int32 with
  their ``-1`` padding last (the selection puts valid keys first);
* every tensor contiguous: the op never accepts a non-contiguous ``query``, ``query_rope`` or ``sparse_indices``,
  and on Atlas A2/A3 no non-contiguous ``key``, ``value`` or ``key_rope`` either (op-plugin's
  ``torch_npu-npu_sparse_flash_attention.md``), while the nope/rope parts are slices of ``q`` and ``kv``: each is
  copied out (``key`` once, passed as ``value`` too: MLA-absorb shares one tensor);
* ``return_softmax_lse=True``: slime's ``lse`` (base 2, [T, H]) is ``(softmax_max + ln softmax_sum) / ln 2``,
  the op's two [N2=1, T, H] statistics read as [T, H] (``softmax_max`` is the max of the scaled scores, the
  convention op-plugin's KL-loss test reads them back with).

The backward stays the torch op (:func:`slime_ascend.glm5.ops.sparse_mla_bwd`), which needs only ``out`` and
``lse``. Not run on an Ascend device here: the tests call the emulated ``torch.ops.npu`` op
(:mod:`slime_ascend.npu_emulation.ops`: op-plugin's schema, a host reference body that enforces the documented
limits) and compare the result with the torch op.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .ops import sparse_mla_fwd_interface as torch_sparse_mla_fwd_interface

__all__ = ["fits_npu_op", "make_sparse_mla_fwd_interface"]

D_V = 512
D_ROPE = 64
HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
_LN2 = math.log(2.0)


def fits_npu_op(q: torch.Tensor, kv: torch.Tensor, d_v: int, return_p_sum: bool) -> bool:
    """Whether a call is within the fused op's limits (module docstring)."""
    return (not return_p_sum and int(d_v) == D_V and q.dim() == 3 and kv.dim() == 3 and kv.shape[1] == 1
            and q.shape[-1] == kv.shape[-1] == D_V + D_ROPE and q.shape[1] in HEADS
            and q.dtype in (torch.bfloat16, torch.float16) and kv.dtype == q.dtype)


def make_sparse_mla_fwd_interface(op: Callable) -> Callable:
    """slime's ``sparse_mla_fwd_interface`` over ``op`` (``torch_npu.npu_sparse_flash_attention``)."""

    def sparse_mla_fwd_interface(q, kv, indices, sm_scale=None, return_p_sum: bool = False, d_v=512, block_I=64,
                                 num_stages=2, threads=256):
        if not fits_npu_op(q, kv, d_v, return_p_sum):
            return torch_sparse_mla_fwd_interface(q, kv, indices, sm_scale, return_p_sum, d_v, block_I, num_stages,
                                                  threads)
        seq_len, heads, dim = q.shape
        scale = dim ** -0.5 if sm_scale is None else float(sm_scale)
        lengths_q = torch.tensor([seq_len], dtype=torch.int32, device=q.device)
        lengths_kv = torch.tensor([kv.shape[0]], dtype=torch.int32, device=q.device)
        latent = kv[..., :D_V].contiguous()  # key and value: one tensor (MLA-absorb)
        out, softmax_max, softmax_sum = op(
            q[..., :D_V].contiguous(), latent, latent, indices.to(torch.int32).contiguous(), scale,
            actual_seq_lengths_query=lengths_q, actual_seq_lengths_kv=lengths_kv,
            query_rope=q[..., D_V:].contiguous(), key_rope=kv[..., D_V:].contiguous(), sparse_block_size=1,
            layout_query="TND", layout_kv="TND", sparse_mode=3, attention_mode=2, return_softmax_lse=True)
        lse = (softmax_max.float() + torch.log(softmax_sum.float())).reshape(seq_len, heads) / _LN2
        return out.reshape(seq_len, heads, D_V).to(q.dtype), lse

    sparse_mla_fwd_interface.__slime_ascend_npu_op__ = getattr(op, "__name__", "npu_sparse_flash_attention")
    return sparse_mla_fwd_interface

"""Test doubles of torch_npu's fused operators: real ``torch.ops.npu.*`` operators with op-plugin's schemas and
slow host reference bodies that refuse what the device op refuses.

:func:`register` defines each op of :data:`.op_schemas.SCHEMAS` (the ``func:`` line of op-plugin's
``op_plugin_functions.yaml``, verbatim, with its repo, commit and line) in the ``npu`` namespace with
``torch.library`` and puts the reference body under ``CompositeExplicitAutograd``: it runs for CPU tensors and for
``PrivateUse1`` ones (the emulated ``npu`` device's tensors reach it as host tensors through their
``__torch_dispatch__``). :func:`attach` exports them on a ``torch_npu`` module as torch_npu does
(``torch_npu.<name> = torch.ops.npu.<name>``, the OpOverloadPacket, whose Python signature is
``(*args, **kwargs)``). Nothing here ever shadows a real torch_npu: an op the namespace already has (a real
torch_npu's) is left alone, and tests of these bodies skip where torch_npu is importable.

The bodies check the documented input constraints (op-plugin's ``docs/zh/custom_APIs/torch_npu`` pages and the
C++/meta wrappers' ``TORCH_CHECK``\\s, :data:`.op_schemas.DOCS`) and raise ``RuntimeError`` (what a failing
``TORCH_CHECK`` or aclnn parameter check raises) with a one-line message naming the op, the argument and the rule.
Where the products differ, the rules of Atlas A2/A3 (:data:`PRODUCT`, the stricter ones) apply: no ``sinks``,
query heads 1, 2, 4, ..., 128 (sparse attention) or at most 64 (indexer), and no non-contiguous key / value /
key_rope. The paged layout ``PA_BSND`` (``block_table``) is emulated too (SGLang's indexer calls use it).

What the emulation cannot say: the kernels' numerics (the bodies accumulate in float32 on the host; the device's
rounding, and so its near-tie order, differs), and anything the documentation leaves open, each named in the
body's docstring. Neither op gets a derivative here (the real ones have one: op-plugin
``op_plugin/config/derivatives.yaml:341`` and ``:345``); the package calls the sparse attention only inside
slime's autograd Function, whose backward is the torch op.
"""

from __future__ import annotations

import torch

from .op_schemas import SCHEMAS

__all__ = ["PRODUCT", "attach", "npu_fusion_attention", "npu_lightning_indexer", "npu_sparse_flash_attention", "register", "registered"]

#: The product whose documented limits the bodies enforce.
PRODUCT = "Atlas A2/A3"
NAMESPACE = "npu"
_MAX_TOKENS = 9223372036854775807  # pre_tokens / next_tokens: only the default is supported by either op
_LAYOUTS_QUERY = ("BSND", "TND")
_LAYOUTS_KV = ("BSND", "TND", "PA_BSND")
_HALF = (torch.bfloat16, torch.float16)
_MASKED = -1e12  # what op-plugin's CPU reference writes into causally masked scores (test_npu_sparse_flash_attention.py:50)

_LIBRARY: torch.library.Library | None = None  # kept alive: a collected Library takes its registrations with it
_DEFINED: set[str] = set()


class _Checks:
    """``require(cond, message)`` raising ``RuntimeError("<op>: <message>")``."""

    def __init__(self, op: str):
        self.op = op

    def require(self, condition: bool, message: str) -> None:
        if not condition:
            raise RuntimeError(f"{self.op}: {message}")

    def contiguous(self, name: str, tensor: torch.Tensor | None, why: str) -> None:
        self.require(tensor is None or tensor.is_contiguous(),
                     f"{name} is not contiguous ({why}): pass {name}.contiguous()")

    def dtype(self, name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
        self.require(tensor.dtype in allowed,
                     f"{name} has dtype {tensor.dtype}, expected one of {', '.join(str(d) for d in allowed)}")

    def lengths(self, name: str, tensor: torch.Tensor | None) -> list[int] | None:
        if tensor is None:
            return None
        self.require(tensor.dtype == torch.int32 and tensor.dim() == 1,
                     f"{name} must be a 1-D int32 tensor, got {tensor.dtype} of shape {tuple(tensor.shape)}")
        values = [int(v) for v in tensor.tolist()]
        self.require(all(v >= 0 for v in values), f"{name} has a negative length: {values}")
        return values

    def defaults(self, pre_tokens: int, next_tokens: int) -> None:
        self.require(pre_tokens == _MAX_TOKENS and next_tokens == _MAX_TOKENS,
                     f"pre_tokens / next_tokens support only the default {_MAX_TOKENS}, "
                     f"got {pre_tokens} / {next_tokens}")


def _query_rows(c: _Checks, layout: str, query: torch.Tensor, lengths_arg: str,
                lengths: list[int] | None) -> list[tuple[int, int]]:
    """Per batch, the ``(start, end)`` rows of the query flattened to ``[rows, N, D]`` (BSND: ``b * S + s``)."""
    if layout == "TND":
        c.require(lengths is not None, f"{lengths_arg} is required when the query layout is TND")
        c.require(len(lengths) > 0 and all(a <= b for a, b in zip(lengths, lengths[1:])),
                  f"{lengths_arg} is a prefix sum under TND: each value >= the one before, got {lengths}")
        c.require(lengths[-1] <= query.shape[0], f"{lengths_arg} ends at {lengths[-1]} > T = {query.shape[0]}")
        starts = [0, *lengths[:-1]]
        return list(zip(starts, lengths))
    batch, seq = query.shape[0], query.shape[1]
    if lengths is None:
        lengths = [seq] * batch
    c.require(len(lengths) == batch and all(v <= seq for v in lengths),
              f"{lengths_arg} must give one length <= S = {seq} per batch ({batch}), got {lengths}")
    return [(b * seq, b * seq + n) for b, n in enumerate(lengths)]


def _key_sequences(c: _Checks, layout: str, tensors: list[torch.Tensor], batches: int, lengths_arg: str,
                   lengths: list[int] | None, block_table: torch.Tensor | None) -> list[list[torch.Tensor]]:
    """Per batch, each of ``tensors`` (key and its companions, same layout) cut to the batch's ``[L, N2, D]``."""
    first = tensors[0]
    if layout == "PA_BSND":
        c.require(block_table is not None, "block_table is required when the key layout is PA_BSND")
        c.require(lengths is not None and len(lengths) == batches,
                  f"{lengths_arg} (one length per batch, {batches}) is required when the key layout is PA_BSND")
        c.require(block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == batches,
                  f"block_table must be int32 [B={batches}, max blocks], got {block_table.dtype} "
                  f"{tuple(block_table.shape)}")
        block_size = first.shape[1]
        c.require(block_size % 16 == 0 and block_size <= 1024,
                  f"the paged block_size (key dim 1) must be a multiple of 16 up to 1024, got {block_size}")
        out = []
        for b, n in enumerate(lengths):
            blocks = -(-n // block_size)
            c.require(blocks <= block_table.shape[1], f"block_table has {block_table.shape[1]} blocks per batch, "
                                                      f"batch {b} needs {blocks} for {n} tokens")
            ids = block_table[b, :blocks].long()
            c.require(bool(((ids >= 0) & (ids < first.shape[0])).all()),
                      f"block_table row {b} names a block outside [0, {first.shape[0]})")
            out.append([t[ids].reshape(-1, *t.shape[2:])[:n] for t in tensors])
        return out
    if layout == "TND":
        c.require(lengths is not None and len(lengths) == batches,
                  f"{lengths_arg} (a prefix sum, one value per batch, {batches}) is required when the key layout "
                  "is TND")
        c.require(all(a <= b for a, b in zip(lengths, lengths[1:])) and lengths[-1] <= first.shape[0],
                  f"{lengths_arg} is a prefix sum under TND ending at most at T = {first.shape[0]}, got {lengths}")
        starts = [0, *lengths[:-1]]
        return [[t[s:e] for t in tensors] for s, e in zip(starts, lengths)]
    seq = first.shape[1]
    c.require(first.shape[0] == batches, f"the key has batch {first.shape[0]}, the query {batches}")
    if lengths is None:
        lengths = [seq] * batches
    c.require(len(lengths) == batches and all(v <= seq for v in lengths),
              f"{lengths_arg} must give one length <= S = {seq} per batch ({batches}), got {lengths}")
    return [[t[b, :n] for t in tensors] for b, n in enumerate(lengths)]


def _layouts(c: _Checks, layout_query: str, layout_kv: str, kv_arg: str) -> None:
    c.require(layout_query in _LAYOUTS_QUERY, f"The layout of query only support BSND and TND, but got {layout_query}")
    c.require(layout_kv in _LAYOUTS_KV, f"{kv_arg} supports {', '.join(_LAYOUTS_KV)}, got {layout_kv}")
    c.require(layout_kv == "PA_BSND" or layout_kv == layout_query,
              f"{kv_arg} ({layout_kv}) must equal layout_query ({layout_query}) unless it is PA_BSND")


def _dims(c: _Checks, name: str, tensor: torch.Tensor, layout: str) -> None:
    want = 3 if layout == "TND" else 4
    c.require(tensor.dim() == want,
              f"When the layout of {name} is {layout}, the {name} dimension must be {want}, but got {tensor.dim()}")


def npu_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, block_table=None,
                               actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                               key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                               sparse_mode=3, pre_tokens=_MAX_TOKENS, next_tokens=_MAX_TOKENS, attention_mode=0,
                               return_softmax_lse=False, sinks=None):
    """Reference body of ``torch_npu.npu_sparse_flash_attention`` (MLA-absorb, ``attention_mode=2``).

    For each batch, query position ``i`` and head ``h``: the selected tokens are ``sparse_indices[i]`` (valid
    entries first, ``-1`` pads the rest) each expanded to ``[b * sparse_block_size, (b+1) * sparse_block_size)``
    and cut at the batch's KV length; ``s = scale_value * [q_nope, q_rope] . [k_nope, k_rope]``; under
    ``sparse_mode=3`` a token ``j > (L_kv - L_q) + i`` scores ``-1e12`` (op-plugin's CPU reference);
    ``attention_out = softmax(s) @ value``. ``softmax_max = max s`` and ``softmax_sum = sum exp(s - max)``
    (natural log, scaled scores: the convention op-plugin's KL-loss test reads them back with), shaped
    ``[N2, T1, N1/N2]`` (TND) or ``[B, N2, S1, N1/N2]`` (BSND) when ``return_softmax_lse``, else empty.

    Unspecified by the docs, chosen here: a query row with no valid index gives ``out = 0``, ``softmax_max =
    -inf``, ``softmax_sum = 0``; query rows past a batch's length give zeros; an index whose tokens lie past
    ``L_kv`` adds nothing (as the CPU reference); a repeated index counts twice. Accumulation is float32.
    """
    c = _Checks("npu_sparse_flash_attention")
    c.require(query.numel() > 0, "Tensor query is empty.")
    c.require(key.numel() > 0, "Tensor key is empty.")
    c.require(value.numel() > 0, "Tensor value is empty.")
    c.require(sparse_indices.numel() > 0, "Tensor sparse_indices is empty.")
    _layouts(c, layout_query, layout_kv, "layout_kv")
    _dims(c, "query", query, layout_query)
    _dims(c, "key", key, "BSND" if layout_kv == "PA_BSND" else layout_kv)
    c.require(attention_mode == 2, f"attention_mode supports only 2 (MLA-absorb), got {attention_mode}")
    c.require(query_rope is not None and key_rope is not None,
              "attention_mode=2 (MLA-absorb) needs query_rope and key_rope")
    # contiguity: query, query_rope and sparse_indices never; key / value / key_rope not on A2/A3 (on 950 only
    # dim 0 under PA_BSND)
    for name, tensor in (("query", query), ("query_rope", query_rope), ("sparse_indices", sparse_indices)):
        c.contiguous(name, tensor, "the op does not support a non-contiguous " + name)
    for name, tensor in (("key", key), ("value", value), ("key_rope", key_rope)):
        c.contiguous(name, tensor, f"{PRODUCT} do not support a non-contiguous {name}")
    for name, tensor in (("query", query), ("key", key), ("value", value), ("query_rope", query_rope),
                         ("key_rope", key_rope)):
        c.dtype(name, tensor, _HALF)
    c.require(query.dtype == key.dtype == value.dtype == query_rope.dtype == key_rope.dtype,
              f"query, key, value, query_rope and key_rope must share one dtype, got {query.dtype}, {key.dtype}, "
              f"{value.dtype}, {query_rope.dtype}, {key_rope.dtype}")
    c.require(query.shape[-1] == key.shape[-1] == value.shape[-1] == 512,
              f"the D of query, key and value must be 512, got {query.shape[-1]}, {key.shape[-1]}, "
              f"{value.shape[-1]}")
    c.require(query_rope.shape[-1] == key_rope.shape[-1] == 64,
              f"the D of query_rope and key_rope must be 64, got {query_rope.shape[-1]}, {key_rope.shape[-1]}")
    c.require(query_rope.shape[:-1] == query.shape[:-1], f"query_rope {tuple(query_rope.shape)} must match query "
                                                         f"{tuple(query.shape)} but for D")
    c.require(key_rope.shape[:-1] == key.shape[:-1] and value.shape == key.shape,
              f"value {tuple(value.shape)} must equal key {tuple(key.shape)} and key_rope "
              f"{tuple(key_rope.shape)} match it but for D")
    c.require(torch.equal(key, value), "attention_mode=2 (MLA-absorb): key and value must share one tensor's data")
    heads, kv_heads = query.shape[-2], key.shape[-2]
    c.require(kv_heads == 1, f"KV_N (key dim -2) supports only 1, got {kv_heads}")
    c.require(heads in (1, 2, 4, 8, 16, 32, 64, 128), f"{PRODUCT}: query heads N1 must be 1/2/4/.../128, got {heads}")
    c.dtype("sparse_indices", sparse_indices, (torch.int32,))
    lead = query.shape[:-2]
    c.require(sparse_indices.dim() == len(lead) + 2 and tuple(sparse_indices.shape[:-2]) == tuple(lead)
              and sparse_indices.shape[-2] == kv_heads and sparse_indices.shape[-1] > 0,
              f"sparse_indices must be [{', '.join(map(str, lead))}, KV_N={kv_heads}, sparse_size>0] for "
              f"layout_query {layout_query}, got {tuple(sparse_indices.shape)}")
    c.require(sparse_block_size in (1, 2, 4, 8, 16, 32, 64, 128),
              f"sparse_block_size must be a power of 2 in [1, 128], got {sparse_block_size}")
    if layout_kv == "PA_BSND":
        c.require(key.shape[1] % sparse_block_size == 0,
                  f"sparse_block_size {sparse_block_size} must divide the paged block_size {key.shape[1]}")
    c.require(sparse_mode in (0, 3), f"sparse_mode supports 0 and 3, got {sparse_mode}")
    c.defaults(pre_tokens, next_tokens)
    c.require(sinks is None, f"{PRODUCT} do not support sinks")
    c.require(not (return_softmax_lse and layout_kv == "PA_BSND"),
              "return_softmax_lse=True is supported only when layout_kv is not PA_BSND")

    flat_idx = sparse_indices.reshape(-1, sparse_indices.shape[-1])
    c.require(bool((flat_idx >= -1).all()), "sparse_indices holds a value below -1 (-1 pads, the rest are blocks)")
    pad = flat_idx == -1
    c.require(not bool(((pad.int().cummax(-1).values > 0) & ~pad).any()),
              "sparse_indices rows must hold their valid values first and the -1 padding after them")

    lengths_q = c.lengths("actual_seq_lengths_query", actual_seq_lengths_query)
    lengths_kv = c.lengths("actual_seq_lengths_kv", actual_seq_lengths_kv)
    rows = _query_rows(c, layout_query, query, "actual_seq_lengths_query", lengths_q)
    sequences = _key_sequences(c, layout_kv, [key, key_rope, value], len(rows), "actual_seq_lengths_kv", lengths_kv,
                               block_table)

    q_all = torch.cat((query, query_rope), -1).reshape(-1, heads, 576).float()
    idx_all = sparse_indices.reshape(-1, sparse_indices.shape[-1]).long()
    out = torch.zeros(q_all.shape[0], heads, 512, dtype=torch.float32, device=query.device)
    row_max = torch.full((q_all.shape[0], heads), float("-inf"), dtype=torch.float32, device=query.device)
    row_sum = torch.zeros((q_all.shape[0], heads), dtype=torch.float32, device=query.device)
    offsets = torch.arange(sparse_block_size, device=query.device)
    for (start, end), (k_seq, k_rope_seq, v_seq) in zip(rows, sequences):
        n_q, n_kv = end - start, k_seq.shape[0]
        if n_q == 0:
            continue
        keys = torch.cat((k_seq, k_rope_seq), -1)[:, 0].float()  # [L_kv, 576]
        values = v_seq[:, 0].float()  # [L_kv, 512]
        idx = idx_all[start:end]  # [n_q, K]
        tokens = (idx[..., None] * sparse_block_size + offsets).reshape(n_q, -1)  # [n_q, K * block]
        valid = (idx[..., None] >= 0).expand(-1, -1, sparse_block_size).reshape(n_q, -1) & (tokens < n_kv)
        safe = torch.where(valid, tokens, torch.zeros_like(tokens))
        scores = torch.einsum("qhd,qkd->qhk", q_all[start:end], keys[safe]) * float(scale_value)
        if sparse_mode == 3:
            limit = (n_kv - n_q) + torch.arange(n_q, device=query.device)
            scores = scores.masked_fill((tokens > limit[:, None])[:, None, :], _MASKED)
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        m = scores.amax(-1)
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        e = torch.exp(scores - m_safe[..., None])
        s = e.sum(-1)
        p = e / torch.where(s > 0, s, torch.ones_like(s))[..., None]
        out[start:end] = torch.einsum("qhk,qkd->qhd", p, values[safe])
        row_max[start:end], row_sum[start:end] = m, s
    attention_out = out.to(query.dtype).reshape(query.shape)
    if not return_softmax_lse:
        empty = torch.empty(0, dtype=torch.float32, device=query.device)
        return attention_out, empty, empty.clone()
    if layout_query == "TND":  # [N2, T1, N1 / N2] with N2 = 1
        shape = (1, query.shape[0], heads)
        return attention_out, row_max.reshape(shape), row_sum.reshape(shape)
    shape = (query.shape[0], query.shape[1], 1, heads)  # [B, S1, N2, N1/N2] -> [B, N2, S1, N1/N2]
    return (attention_out, row_max.reshape(shape).transpose(1, 2).contiguous(),
            row_sum.reshape(shape).transpose(1, 2).contiguous())


_SPARSE_COUNTS = (3072, 4096, 5120, 6144, 7168, 8192)


def npu_lightning_indexer(query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                          block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3,
                          pre_tokens=_MAX_TOKENS, next_tokens=_MAX_TOKENS, return_value=False):
    """Reference body of ``torch_npu.npu_lightning_indexer``: per batch and query position ``i``, the score of
    key ``j`` is ``sum_h weights[i, h] * relu(query[i, h] . key[j])`` (float32), and ``sparse_indices[i]`` the
    ``sparse_count`` highest-scoring keys (positions within the batch's key sequence), highest first; under
    ``sparse_mode=3`` only keys ``j <= (L_k - L_q) + i`` compete. ``sparse_values`` (with ``return_value``) are
    their scores in the query's dtype, else an empty tensor.

    Unspecified by the docs, chosen here: equal scores are ordered by the lower key position first (the device's
    tie order, and its order of nearly equal scores under its own rounding, may differ); slots past the number of
    keys that may compete hold ``-1`` (the padding ``npu_sparse_flash_attention`` reads; op-plugin's CPU reference
    pads with ``-1`` only past ``S2``) and their values ``-inf``; query rows past a batch's length hold ``-1``.
    """
    c = _Checks("npu_lightning_indexer")
    c.require(query.numel() > 0, "Tensor query is empty.")
    c.require(key.numel() > 0, "Tensor key is empty.")
    for name, tensor in (("query", query), ("key", key)):
        c.require(all(d > 0 for d in tensor.shape), f"All values within {name}'s shape should be greater than 0, "
                                                    f"but shape is {tuple(tensor.shape)}")
    c.require(sparse_count > 0, f"sparse count should be greater than 0, but now is {sparse_count}")
    c.require(sparse_count <= 2048 or sparse_count in _SPARSE_COUNTS,
              f"sparse_count supports [1, 2048] and {', '.join(map(str, _SPARSE_COUNTS))}, got {sparse_count}")
    _layouts(c, layout_query, layout_key, "layout_key")
    _dims(c, "query", query, layout_query)
    _dims(c, "key", key, "BSND" if layout_key == "PA_BSND" else layout_key)
    c.contiguous("query", query, "the op does not support a non-contiguous query")
    c.contiguous("weights", weights, "the op does not support non-contiguous weights")
    c.contiguous("key", key, f"{PRODUCT} do not support a non-contiguous key")
    c.dtype("query", query, _HALF)
    c.require(key.dtype == query.dtype, f"query and key must share one dtype, got {query.dtype} and {key.dtype}")
    c.dtype("weights", weights, (*_HALF, torch.float32))
    c.require(weights.dtype in (torch.float32, query.dtype),
              f"weights ({weights.dtype}) must be float32 or the query's dtype ({query.dtype})")
    c.require(query.shape[-1] == key.shape[-1] == 128,
              f"the D of query and key must be 128, got {query.shape[-1]} and {key.shape[-1]}")
    heads = query.shape[-2]
    c.require(key.shape[-2] == 1, f"the key's N (N2) supports only 1, got {key.shape[-2]}")
    c.require(heads <= 64, f"{PRODUCT}: the query's N (N1) must be at most 64, got {heads}")
    c.require(tuple(weights.shape) == tuple(query.shape[:-1]),
              f"weights must be {list(query.shape[:-1])} ([B, S1, N1] or [T, N1]), got {list(weights.shape)}")
    c.require(sparse_mode in (0, 3), f"sparse_mode supports 0 and 3, got {sparse_mode}")
    c.defaults(pre_tokens, next_tokens)
    c.require(not (return_value and layout_key == "PA_BSND"),
              "return_value=True is supported only when layout_key is not PA_BSND")

    lengths_q = c.lengths("actual_seq_lengths_query", actual_seq_lengths_query)
    lengths_k = c.lengths("actual_seq_lengths_key", actual_seq_lengths_key)
    rows = _query_rows(c, layout_query, query, "actual_seq_lengths_query", lengths_q)
    sequences = _key_sequences(c, layout_key, [key], len(rows), "actual_seq_lengths_key", lengths_k, block_table)

    q_all = query.reshape(-1, heads, 128).float()
    w_all = weights.reshape(-1, heads).float()
    indices = torch.full((q_all.shape[0], sparse_count), -1, dtype=torch.int32, device=query.device)
    values = torch.full((q_all.shape[0], sparse_count), float("-inf"), dtype=torch.float32, device=query.device)
    for (start, end), (k_seq,) in zip(rows, sequences):
        n_q, n_k = end - start, k_seq.shape[0]
        if n_q == 0 or n_k == 0:
            continue
        relu = torch.einsum("qhd,kd->qhk", q_all[start:end], k_seq[:, 0].float()).clamp_min(0)
        scores = (relu * w_all[start:end, :, None]).sum(1)  # [n_q, n_k]
        allowed = torch.ones_like(scores, dtype=torch.bool)
        if sparse_mode == 3:
            limit = (n_k - n_q) + torch.arange(n_q, device=query.device)
            allowed = torch.arange(n_k, device=query.device)[None, :] <= limit[:, None]
        ranked = scores.masked_fill(~allowed, float("-inf"))
        order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :sparse_count]
        taken = torch.gather(allowed, 1, order)
        width = order.shape[1]
        indices[start:end, :width] = torch.where(taken, order, torch.full_like(order, -1)).to(torch.int32)
        values[start:end, :width] = torch.where(taken, torch.gather(scores, 1, order),
                                                torch.full_like(scores[:, :width], float("-inf")))
    shape = (*query.shape[:-2], 1, sparse_count)  # [B, S1, N2, count] or [T1, N2, count]
    sparse_values = values.to(query.dtype).reshape(shape) if return_value else torch.empty(
        0, dtype=query.dtype, device=query.device)
    return indices.reshape(shape), sparse_values


_FA_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD")
_FA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FA_MAX_TOCKENS = 2147483647


def _to_bnsd(c: _Checks, name: str, tensor: torch.Tensor, layout: str, heads: int | None) -> torch.Tensor:
    dims = 3 if layout in ("BSH", "SBH") else 4
    c.require(tensor.dim() == dims, f"{name} must be {dims}-D for input_layout {layout}, got shape "
              f"{tuple(tensor.shape)}")
    if layout == "BNSD":
        return tensor
    if layout == "BSND":
        return tensor.transpose(1, 2)
    hidden = tensor.shape[-1]
    c.require(heads is not None and heads > 0 and hidden % heads == 0,
              f"{name}'s hidden size {hidden} is not a multiple of its head count {heads}")
    if layout == "SBH":
        tensor = tensor.transpose(0, 1)
    return tensor.reshape(tensor.shape[0], tensor.shape[1], heads, hidden // heads).transpose(1, 2)


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1.0, keep_prob=1.0, pre_tockens=_FA_MAX_TOCKENS, next_tockens=_FA_MAX_TOCKENS,
                         inner_precise=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False, softmax_layout="", sink=None, dropout_mask=None, seed=0,
                         offset=0):
    """Reference body of ``torch_npu.npu_fusion_attention`` (the training flash attention transformers' Ascend
    path imports), for what the emulation covers: layouts BSH, SBH, BSND and BNSD, MHA and GQA, ``atten_mask``
    (bool / uint8, 1 = not attended; shapes BNSS, B1SS, 11SS, SS) with ``sparse_mode`` 0 (the mask as given, default
    ``pre_tockens`` / ``next_tockens``), 2 (causal aligned top-left) or 3 (causal aligned bottom-right; both take
    the 2048 x 2048 compressed mask), no dropout. Everything else the op offers (TND / varlen, ``pse``, ``prefix``,
    ``sink``, dropout, the other sparse modes) is refused in one line as not emulated. Returns the op's seven
    outputs: attention_out (query's layout and dtype), softmax_max and softmax_sum ([B, N, Sq, 8] float32, the
    row max and the sum of exp(score - max), broadcast over the last dimension), the reserved softmax_out (empty),
    and seed, offset, numels (0: no dropout mask)."""
    c = _Checks("npu_fusion_attention")
    c.require(input_layout in _FA_LAYOUTS + ("TND",), f"input_layout {input_layout!r} is not one of BSH, SBH, "
              "BSND, BNSD, TND")
    for name, value_ in (("input_layout TND (varlen)", input_layout == "TND"), ("pse", pse is not None),
                         ("padding_mask", padding_mask is not None), ("prefix", prefix is not None),
                         ("actual_seq_qlen", actual_seq_qlen is not None),
                         ("actual_seq_kvlen", actual_seq_kvlen is not None), ("sink", sink is not None),
                         ("dropout (keep_prob < 1, dropout_mask)", keep_prob != 1.0 or dropout_mask is not None)):
        c.require(not value_, f"{name} is not emulated (the emulated op covers BSH/SBH/BSND/BNSD, atten_mask with "
                  "sparse_mode 0, 2 or 3, no dropout)")
    c.require(0 < keep_prob <= 1, f"keep_prob must be in (0, 1], got {keep_prob}")
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        c.dtype(name, tensor, _FA_DTYPES)
    c.require(query.dtype == key.dtype == value.dtype, f"query, key and value must share a dtype, got {query.dtype}, "
              f"{key.dtype}, {value.dtype}")
    c.require(key.shape == value.shape, f"key and value must have one shape, got {tuple(key.shape)} and "
              f"{tuple(value.shape)}")
    q = _to_bnsd(c, "query", query, input_layout, head_num)
    c.require(q.shape[1] == head_num, f"head_num {head_num} does not match query's {q.shape[1]} heads")
    kv_heads = None
    if input_layout in ("BSH", "SBH"):
        c.require(key.shape[-1] % (query.shape[-1] // head_num) == 0, "key's hidden size is not a multiple of "
                  "query's head dimension")
        kv_heads = key.shape[-1] // (query.shape[-1] // head_num)
    k = _to_bnsd(c, "key", key, input_layout, kv_heads)
    v = _to_bnsd(c, "value", value, input_layout, kv_heads)
    batch, heads, sq, dim = q.shape
    c.require(k.shape[0] == batch, f"key's batch {k.shape[0]} differs from query's {batch}")
    c.require(k.shape[3] == dim, f"key's head dimension {k.shape[3]} differs from query's {dim} (Dq = Dk)")
    c.require(k.shape[1] > 0 and heads % k.shape[1] == 0, f"query's {heads} heads are not a multiple of key/value's "
              f"{k.shape[1]} (Nq / Nkv must be a non-zero integer)")
    c.require(1 <= heads <= 256 and 1 <= dim <= 768, f"heads {heads} (1..256) or head dimension {dim} (1..768) out "
              "of range")
    skv = k.shape[2]
    c.require(sparse_mode in (0, 2, 3), f"sparse_mode {sparse_mode} is not emulated (0, 2 and 3 are)")
    mask = None  # True: not attended, [B or 1, N or 1, Sq, Skv]
    if atten_mask is not None:
        c.require(atten_mask.dtype in (torch.bool, torch.uint8), f"atten_mask has dtype {atten_mask.dtype}, "
                  "expected torch.bool or torch.uint8")
        if sparse_mode == 0:
            c.require(pre_tockens == _FA_MAX_TOCKENS and next_tockens == _FA_MAX_TOCKENS,
                      "pre_tockens / next_tockens other than the default are not emulated with sparse_mode 0")
            shapes = ((sq, skv), (1, 1, sq, skv), (batch, 1, sq, skv), (batch, heads, sq, skv))
            c.require(tuple(atten_mask.shape) in shapes, f"atten_mask has shape {tuple(atten_mask.shape)}, expected "
                      f"one of {', '.join(str(x) for x in shapes)} (SS, 11SS, B1SS, BNSS)")
            mask = atten_mask.bool().reshape((1, 1, sq, skv) if atten_mask.dim() == 2 else atten_mask.shape)
        else:
            c.require(tuple(atten_mask.shape) == (2048, 2048), f"sparse_mode {sparse_mode} takes the compressed "
                      f"2048 x 2048 causal mask, got shape {tuple(atten_mask.shape)}")
            shift = 0 if sparse_mode == 2 else skv - sq  # 2: top-left aligned, 3: bottom-right aligned
            rows = torch.arange(sq).unsqueeze(1)
            mask = (torch.arange(skv).unsqueeze(0) > rows + shift).reshape(1, 1, sq, skv)
    groups = heads // k.shape[1]
    kf = k.float().repeat_interleave(groups, dim=1)
    vf = v.float().repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    c.require(bool(torch.isfinite(row_max).all()), "atten_mask masks every key of a query row (not emulated: "
              "the documentation rules it out for varlen and leaves its result open otherwise)")
    weights = torch.exp(scores - row_max)
    row_sum = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights / row_sum, vf).to(query.dtype)  # [B, N, Sq, Dv]
    if input_layout == "BSND":
        out = out.transpose(1, 2)
    elif input_layout in ("BSH", "SBH"):
        out = out.transpose(1, 2).reshape(batch, sq, heads * out.shape[-1])
        if input_layout == "SBH":
            out = out.transpose(0, 1)
    softmax_max = row_max.expand(batch, heads, sq, 8).contiguous()
    softmax_sum = row_sum.expand(batch, heads, sq, 8).contiguous()
    return out.contiguous(), softmax_max, softmax_sum, query.new_empty((0,)), 0, 0, 0


_BODIES = {"npu_sparse_flash_attention": npu_sparse_flash_attention, "npu_lightning_indexer": npu_lightning_indexer,
           "npu_fusion_attention": npu_fusion_attention}


def _has_op(name: str) -> bool:
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def register() -> tuple[str, ...]:
    """Define each op of :data:`.op_schemas.SCHEMAS` as ``torch.ops.npu.<name>`` with its schema string and its
    reference body (``CompositeExplicitAutograd``: CPU and PrivateUse1). Idempotent; an op the namespace already
    holds that this module did not define (a real torch_npu's) is left alone. Returns the names defined here."""
    global _LIBRARY
    for name, schema in SCHEMAS.items():
        if name in _DEFINED or _has_op(name):
            continue
        if _LIBRARY is None:
            _LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")  # FRAGMENT: the emulated device may add to "npu"
        _LIBRARY.define(schema.func)
        _LIBRARY.impl(name, _BODIES[name], "CompositeExplicitAutograd")
        _DEFINED.add(name)
    return registered()


def registered() -> tuple[str, ...]:
    """The ops :func:`register` defined in this process."""
    return tuple(sorted(_DEFINED))


def attach(torch_npu_module) -> None:
    """Export ``torch.ops.npu`` on ``torch_npu_module`` as torch_npu's ``_export_npu_ops`` does
    (:data:`.op_schemas.EXPORT_SOURCE`): ``module.<name> = torch.ops.npu.<name>`` (the OpOverloadPacket) for every
    name in ``dir(torch.ops.npu)`` but dunders, ``_dir`` and ``name``. torch_npu's deprecated ``torch.<name>``
    wrappers are not installed (they would set attributes on torch itself). ``dir`` of an op namespace lists
    only the ops bound so far (torch_npu's own import binds its ops before exporting), so the ops of
    :data:`.op_schemas.SCHEMAS` present are bound first."""
    namespace = getattr(torch.ops, NAMESPACE)
    for name in SCHEMAS:
        if _has_op(name):
            getattr(namespace, name)
    for name in dir(namespace):
        if name.startswith("__") or name in ("_dir", "name"):
            continue
        setattr(torch_npu_module, name, getattr(namespace, name))

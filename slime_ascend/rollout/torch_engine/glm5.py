"""GLM-5 as its checkpoint defines it, on transformers' ``GlmMoeDsa`` (the torch engine's GLM-5).

transformers 5.12's ``modeling_glm_moe_dsa`` departs from the semantics GLM-5 is served with (SGLang's
``deepseek_v2`` / DSA indexer, vLLM's) and trained with (slime's ``slime_plugins/models/glm5`` spec) in two places:

* **The lightning indexer's RoPE.** zai-org's GLM-5 ``config.json`` sets ``"indexer_rope_interleave": true``;
  SGLang builds the indexer's rotary embedding with ``is_neox_style=not config.indexer_rope_interleave`` (GPT-J
  style: adjacent pairs ``(x[2i], x[2i+1])`` rotated by frequency ``i``), and slime's spec de-interleaves the 64
  RoPE dims (``cat(x[..., 0::2], x[..., 1::2])``) before its half-split THD RoPE, which is the same rotation.
  transformers never reads the flag and rotates halves (``rotate_half``: ``x[i]`` with ``x[i + 32]``), so on a
  GLM-5 checkpoint its indexer scores, and with them the selected top-k keys, are not GLM-5's once a sequence
  is longer than ``index_topk``.
* **The MLA latent norms' epsilon.** SGLang's ``q_a_layernorm`` / ``kv_a_layernorm`` use
  ``config.rms_norm_eps`` (slime's spec: ``--norm-epsilon``, the same value); transformers builds both with its
  ``GlmMoeDsaRMSNorm`` default, ``1e-6``. For GLM-5 (``rms_norm_eps`` 1e-5) that is a small, systematic gap in
  every attention output.

A third is a bug on one path: on a prefill after a KV cache (a prefix-cache hit) the attention gets a boolean mask,
and its DSA masking (``masked_fill(..., finfo.min)``) does nothing to it, so that chunk attends to every past key.

:func:`align_glm_moe_dsa` makes a loaded ``GlmMoeDsaForCausalLM`` follow the checkpoint: the two norms take
``config.rms_norm_eps``, each attention becomes a ``GLM5CheckpointAttention`` (an additive mask in place of a
boolean one), and each indexer becomes a ``GLM5CheckpointIndexer`` (transformers' indexer; its forward
has transformers 5.12's projections, cache, scoring and masking) that rotates the RoPE dims as
``config.indexer_rope_interleave`` says (GPT-J pairs when true; halves when false or absent, SGLang's default).
Two numerics follow slime's spec, so that an fp32 engine selects the keys slime's fp32 spec selects:

* the indexer key is bfloat16 from its norm on and rotated in bfloat16 (``GLM5CheckpointIndexer.key_dtype``;
  slime: ``self.k_norm(...).bfloat16()`` in any model dtype; SGLang keeps it in a bf16 / fp8 cache), and
* the top-k is selected by the ``dsa-determinism`` rule (:func:`select_topk`: best first, ties to the lower
  index, masked keys never). The indexer's ReLU'd scores tie at exactly 0 often; ``torch.topk`` (transformers',
  and slime's own unless the ``dsa-determinism`` plugin's ``train.dsa_deterministic_topk`` is on) breaks ties
  in no fixed order.

Weights are untouched: weight updates, saved checkpoints and slime's converters see the HF layout. Any other
model is returned as it is.

Measured on the tiny GLM-5 in fp32 (tests/glm5/test_glm5_train_rollout_logprobs.py): per-token log-probs of
slime's spec (with ``dsa-determinism``) and of the aligned engine agree within about 3e-7; without the alignment
they differ by up to 0.4 (the indexer RoPE), with a float32 indexer key by 4e-2 (flipped selections), with the
norms' 1e-6 epsilon by 4e-5 (the 3.4e-5 logits gap once put down to the absorbed MLA).
"""

from __future__ import annotations

import torch

__all__ = ["IndexSetRecorder", "align_glm_moe_dsa", "attends_as_selected_after_a_cache", "is_glm_moe_dsa",
           "select_topk"]

_MARK = "_slime_ascend_glm5_aligned"
_INDEXER_CLASS: dict[type, type] = {}


def is_glm_moe_dsa(model: torch.nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) == "glm_moe_dsa"


def select_topk(index_scores: torch.Tensor, blocked: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 [..., min(topk, T)] keys of ``index_scores`` [..., T] by the ``dsa-determinism`` rule (best first,
    ties to the lower index, ``blocked`` keys never), as slime's spec selects them. transformers' indexer
    returns ``min(topk, T)`` indices that its attention scatters into a mask; a slot with no selectable key
    (early queries) gets the row's first selected key, the query's own position at worst, so the set is
    the selected one."""
    from ...dsa.indexer import topk_with_invalid_padding

    scores = index_scores.masked_fill(blocked, float("-inf"))
    _, indices = topk_with_invalid_padding(scores, min(int(topk), scores.shape[-1]))
    return torch.where(indices >= 0, indices, indices[..., :1])


def _indexer_class(base: type) -> type:
    """A subclass of transformers' ``GlmMoeDsaIndexer`` whose forward is transformers 5.12's (projections,
    cache, scoring, masking) with the checkpoint's RoPE layout and slime's selection rule."""
    if base in _INDEXER_CLASS:
        return _INDEXER_CLASS[base]
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

    class GLM5CheckpointIndexer(base):
        """``GlmMoeDsaIndexer`` with GLM-5's indexer RoPE (``config.indexer_rope_interleave``: GPT-J pairs, as
        SGLang and slime's spec; else halves, as transformers), its key in :attr:`key_dtype` and deterministic
        top-k."""

        #: the indexer key's dtype from its norm on (slime's spec: bfloat16 in any model dtype); None: the model's
        key_dtype: torch.dtype | None = torch.bfloat16

        @torch.no_grad()
        def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids,
                    past_key_values=None):
            batch_size, seq_len, _ = hidden_states.shape
            cos, sin = position_embeddings
            rope = self.qk_rope_head_dim
            q = self.wq_b(q_resid).view(batch_size, seq_len, self.n_heads, self.head_dim)
            q_rot, q_pass = torch.split(q, [rope, self.head_dim - rope], dim=-1)
            # the key in bfloat16 from the norm on, rotated in bfloat16, as slime's spec keeps it in any model
            # dtype (glm5.py: ``self.k_norm(...).bfloat16()``, then the THD RoPE in the key's dtype) and SGLang
            # in its bf16 / fp8 indexer cache
            k = self.k_norm(self.wk(hidden_states))
            k = (k if self.key_dtype is None else k.to(self.key_dtype)).unsqueeze(2)
            k_rot, k_pass = torch.split(k, [rope, self.head_dim - rope], dim=-1)
            rotate = (hf.apply_rotary_pos_emb_interleave if getattr(self.config, "indexer_rope_interleave", False)
                      else hf.apply_rotary_pos_emb)  # interleaved: pairs come out evens first (slime's layout)
            q_rot, _ = rotate(q_rot, q_rot, cos, sin, unsqueeze_dim=2)
            k_rot, _ = rotate(k_rot, k_rot, cos.to(k.dtype), sin.to(k.dtype), unsqueeze_dim=2)
            q = torch.cat([q_rot, q_pass], dim=-1)
            k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2).to(q.dtype)  # exact: bf16 values in q's dtype
            if past_key_values is not None:
                k = past_key_values.update_indexer(k, self.layer_idx)
            scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.softmax_scale
            scores = torch.nn.functional.relu(scores)
            weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * (self.n_heads**-0.5)
            index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, S, T]
            if attention_mask is not None:
                # transformers' additive mask (0 / the dtype's min), or a boolean one (True: may attend)
                blocked = ~attention_mask if attention_mask.dtype == torch.bool else attention_mask < 0
            else:
                key_positions = torch.arange(index_scores.shape[-1], device=index_scores.device)
                blocked = key_positions[None, None, :] > position_ids[:, :, None]
            return select_topk(index_scores, blocked, self.index_topk).to(torch.int32)

    _INDEXER_CLASS[base] = GLM5CheckpointIndexer
    return GLM5CheckpointIndexer


_ATTENTION_CLASS: dict[type, type] = {}


def _attention_class(base: type) -> type:
    """A subclass of transformers' ``GlmMoeDsaAttention`` that hands its forward an additive mask where it gets a
    boolean one (see :class:`GLM5CheckpointAttention`)."""
    if base in _ATTENTION_CLASS:
        return _ATTENTION_CLASS[base]

    class GLM5CheckpointAttention(base):
        """``GlmMoeDsaAttention`` whose DSA selection holds on a prefill after a KV cache.

        transformers 5.12's forward drops the keys the indexer did not select with
        ``attention_mask.masked_fill(index_mask, torch.finfo(dtype).min)``, which is right for an additive mask and
        a no-op for the boolean one (``True``: may attend) that ``create_causal_mask`` builds for SDPA when a chunk
        follows a cache: such a chunk attended to every past key (the tiny GLM-5: logits 0.44 to 0.70 from the full
        forward). Here a boolean mask becomes the additive mask it means (0 where it may attend, the dtype's min
        elsewhere) before that forward runs; any other mask, and none, are passed as they are."""

        def forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs):
            if attention_mask is not None and attention_mask.dtype == torch.bool:
                blocked = torch.finfo(hidden_states.dtype).min
                attention_mask = torch.zeros(attention_mask.shape, dtype=hidden_states.dtype,
                                             device=attention_mask.device).masked_fill(~attention_mask, blocked)
            return super().forward(hidden_states, position_embeddings, attention_mask, *args, **kwargs)

    _ATTENTION_CLASS[base] = GLM5CheckpointAttention
    return GLM5CheckpointAttention


def attends_as_selected_after_a_cache(model: torch.nn.Module) -> bool:
    """Whether every DSA attention of ``model`` keeps its selection on a prefill after a KV cache (aligned by
    :func:`align_glm_moe_dsa`)."""
    return all(type(layer.self_attn).__name__ == "GLM5CheckpointAttention" for layer in model.model.layers)


def align_glm_moe_dsa(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (a transformers ``GlmMoeDsa``) made to follow GLM-5's checkpoint semantics (module docstring);
    in place, once; any other model unchanged. Returns ``model``."""
    if not is_glm_moe_dsa(model) or getattr(model, _MARK, False):
        return model
    config = model.config
    eps = float(config.rms_norm_eps)
    rope = int(config.qk_rope_head_dim)
    for layer in model.model.layers:
        attn = layer.self_attn
        for name in ("q_a_layernorm", "kv_a_layernorm"):
            norm = getattr(attn, name, None)
            if norm is not None:
                norm.variance_epsilon = eps
        attn.__class__ = _attention_class(type(attn))
        indexer = getattr(attn, "indexer", None)
        if indexer is None:
            continue
        if rope % 2 or rope > indexer.head_dim:
            raise ValueError(f"config.qk_rope_head_dim={rope}: the indexer's RoPE needs an even width at most "
                             f"index_head_dim={indexer.head_dim}")
        indexer.__class__ = _indexer_class(type(indexer))
    setattr(model, _MARK, True)
    return model


class IndexSetRecorder:
    """The keys each layer's sparse attention read in the last forward pass: the indices every
    ``GlmMoeDsaAttention`` returns (its own indexer's top-k, or on IndexShare's ``shared`` layers the top-k it
    reused), int32 ``[fed tokens, k]`` positions in the sequence per layer (the rollout record of
    :mod:`slime_ascend.dsa.index_sets`). ``None`` for a model without DSA layers (:meth:`for_model`)."""

    def __init__(self, attentions: dict[int, torch.nn.Module]):
        self._seen: dict[int, torch.Tensor] = {}
        for index, attention in attentions.items():
            attention.register_forward_hook(self._hook(index))

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> "IndexSetRecorder | None":
        if not is_glm_moe_dsa(model):
            return None
        # the decoder layers the forward runs: not a checkpoint's MTP layers after them (mtp.py)
        layers = model.model.layers[: int(model.config.num_hidden_layers)]
        return cls({i: layer.self_attn for i, layer in enumerate(layers)})

    def _hook(self, index: int):
        def hook(_module, _inputs, output):
            indices = output[2]  # [batch 1, fed tokens, k]
            self._seen[index] = indices.detach().reshape(-1, indices.shape[-1]).to(torch.int32).cpu()
        return hook

    def take(self) -> dict[int, torch.Tensor]:
        """Each layer's indices of the last forward pass; clears them."""
        seen, self._seen = self._seen, {}
        return seen

"""The multi-token-prediction (MTP) layers of a served checkpoint, held with the model they belong to.

GLM-5 (like DeepSeek-V3 and GLM-4.5) stores ``config.num_nextn_predict_layers`` MTP layers after its decoder layers,
as ``model.layers.<num_hidden_layers + i>.*``: a decoder layer of the model's own kind (attention, DSA indexer,
MoE) plus ``enorm`` / ``hnorm`` (the norms of the next token's embedding and of the model's hidden state),
``eh_proj`` (their concatenation projected back to the hidden size) and ``shared_head.norm``; the embedding and the
LM head are the model's (a checkpoint may also store copies as ``embed_tokens`` / ``shared_head.head``, held
here as stored). transformers drops them on load (``GlmMoeDsaForCausalLM`` ignores them as unexpected keys);
slime's GLM-5 converters read and write them by these names, and slime's weight pushes carry them when the job
trains MTP (``--mtp-num-layers``).

:func:`attach_mtp_layers` appends them to ``model.model.layers``, after the ``num_hidden_layers`` layers the model's
own forward runs (transformers' forward slices ``layers[:num_hidden_layers]``): the model's ``state_dict`` then holds
them under their checkpoint names, so every weight path of the engine (load, disk, tensor, distributed and delta
pushes, ``/get_weights_by_name``) checks, switches and reads them with the model, in one version, and a push that
lacks them is refused by name like any missing weight. :func:`decoder_layers` is what the model's forward runs
(what route and key-set recorders hook). No slime import here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["attach_mtp_layers", "decoder_layers", "mtp_layer_count", "mtp_layers", "mtp_names", "mtp_prefixes"]

_MODULE_EXTRAS = ("enorm", "hnorm", "eh_proj", "shared_head")


def mtp_layer_count(config: Any) -> int:
    """How many MTP layers ``config`` declares (``num_nextn_predict_layers``; 0 when absent)."""
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers ``model``'s own forward runs (``model.model.layers[:num_hidden_layers]``)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return list(layers[: int(model.config.num_hidden_layers)])


def mtp_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MTP layers :func:`attach_mtp_layers` appended (empty for a model without them)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return list(layers[int(model.config.num_hidden_layers):])


def mtp_prefixes(config: Any) -> tuple[str, ...]:
    """The checkpoint name prefixes of ``config``'s MTP layers (``model.layers.<num_hidden_layers + i>.``)."""
    first = int(config.num_hidden_layers)
    return tuple(f"model.layers.{first + i}." for i in range(mtp_layer_count(config)))


def mtp_names(state: dict[str, Any], config: Any) -> list[str]:
    """The names of ``state`` that belong to ``config``'s MTP layers."""
    prefixes = mtp_prefixes(config)
    return [name for name in state if prefixes and name.startswith(prefixes)]


def _layer_config(config: Any, index: int, state: dict[str, torch.Tensor]) -> Any:
    """The config MTP layer ``index`` is built from: ``config`` as a one-layer model whose layer 0 is the MTP layer
    (an MoE layer where ``state`` has experts for it, a DSA indexer of its own where it has one). The layer then
    indexes its own one-layer KV cache (:class:`MTPDraft`) as layer 0; the main forward never runs it."""
    out = copy.deepcopy(config)
    prefix = f"model.layers.{index}."
    kinds = {
        "mlp_layer_types": "sparse" if any(n.startswith(prefix + "mlp.experts.") for n in state) else "dense",
        "indexer_types": "full" if any(n.startswith(prefix + "self_attn.indexer.") for n in state) else "shared",
    }
    for field in ("mlp_layer_types", "indexer_types", "layer_types"):
        values = getattr(out, field, None)
        if isinstance(values, list) and values:
            object.__setattr__(out, field, [kinds.get(field, values[-1])])
    object.__setattr__(out, "num_hidden_layers", 1)
    return out


def attach_mtp_layers(model: torch.nn.Module, state: dict[str, torch.Tensor],
                      to_model_layout: Callable[[torch.nn.Module, dict[str, torch.Tensor]], dict[str, torch.Tensor]]
                      = lambda _model, tensors: tensors) -> int:
    """Append ``model.config``'s MTP layers to ``model.model.layers`` and load them from ``state`` (checkpoint
    names, turned into the model's layout by ``to_model_layout``, e.g. per-expert tensors stacked: the engine passes
    ``model.to_model_layout``; the rest of ``state`` is ignored). Returns how many were attached (0 when the config
    declares none).

    Raises ValueError when the config declares MTP layers that ``state`` does not hold."""
    count = mtp_layer_count(model.config)
    if count == 0:
        return 0

    config = model.config
    first = int(config.num_hidden_layers)
    layers = model.model.layers
    if len(layers) != first:
        raise ValueError(f"the model holds {len(layers)} layers where its config has {first}: MTP layers are "
                         "attached once, to a model just loaded")
    decoder_cls = type(layers[-1])
    norm_cls = type(model.model.norm)
    hidden, eps = int(config.hidden_size), float(config.rms_norm_eps)
    param = next(model.parameters())
    for i in range(count):
        index = first + i
        prefix = f"model.layers.{index}."
        held = {n: t for n, t in state.items() if n.startswith(prefix)}
        if f"{prefix}eh_proj.weight" not in held:
            raise ValueError(f"config.num_nextn_predict_layers is {count} but the checkpoint has no "
                             f"{prefix}eh_proj.weight: its MTP layer {i} is missing")
        layer_config = _layer_config(config, index, state)
        layer = decoder_cls(layer_config, 0)
        layer.mtp_config = layer_config  # what its KV cache is made for (MTPDraft)
        layer.enorm = norm_cls(hidden, eps=eps)
        layer.hnorm = norm_cls(hidden, eps=eps)
        layer.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        layer.shared_head = torch.nn.Module()
        layer.shared_head.norm = norm_cls(hidden, eps=eps)
        if f"{prefix}shared_head.head.weight" in held:
            layer.shared_head.head = torch.nn.Linear(hidden, int(config.vocab_size), bias=False)
        if f"{prefix}embed_tokens.weight" in held:
            layer.embed_tokens = torch.nn.Embedding(int(config.vocab_size), hidden)
        layers.append(layer.to(device=param.device, dtype=param.dtype))
    own = model.state_dict()
    wanted = mtp_names(own, config)
    loaded = to_model_layout(model, {n: state[n] for n in mtp_names(state, config)})
    missing = sorted(set(wanted) - set(loaded))
    unexpected = sorted(set(loaded) - set(wanted))
    if missing or unexpected:
        raise ValueError(f"the checkpoint's MTP layers do not match the model's kind: missing={missing[:5]} "
                         f"(total {len(missing)}), unexpected={unexpected[:5]} (total {len(unexpected)})")
    with torch.no_grad():
        for name, tensor in loaded.items():
            if tensor.shape != own[name].shape:
                raise ValueError(f"MTP weight {name}: shape {tuple(tensor.shape)}, the model's "
                                 f"{tuple(own[name].shape)}")
            own[name].copy_(tensor)
    return count


class MTPDraftState:
    """One request's MTP-layer KV cache and how many of its rows (positions with the served model's own hidden
    state) it holds."""

    def __init__(self) -> None:
        self.cache: Any = None
        self.rows = 0


class MTPDraft:
    """Drafting with ``model``'s first MTP layer, as SGLang's NEXTN / EAGLE over a checkpoint's own MTP layer and as
    Megatron trains it (``multi_token_prediction.py``): row ``i`` of the layer's input is
    ``eh_proj([enorm(embed(x[i + 1])), hnorm(h[i])])`` with ``h[i]`` the served model's final hidden state at position
    ``i`` (after its final norm), read with RoPE position ``i`` and causal attention over the rows before it; the
    row's output after ``shared_head.norm`` gives the draft logits for ``x[i + 2]`` (through ``shared_head.head``
    where the checkpoint has one, else the model's LM head) and stands in for ``h[i + 1]`` in the next draft step,
    whose served-model hidden state does not exist yet.

    The layer keeps its own KV cache per request (:class:`MTPDraftState`): the rows of positions whose served-model
    hidden state exists are fed once, as they become known; the rows drafted on stand-ins are fed after them and
    cut off again once the step has drafted (the served model then verifies, and its hidden states replace them)."""

    def __init__(self, model: torch.nn.Module):
        layers = mtp_layers(model)
        if not layers:
            raise ValueError("the served checkpoint has no MTP layer (config.num_nextn_predict_layers): NEXTN / EAGLE "
                             "speculation drafts with the model's own MTP layer. Fix: serve a checkpoint with one, or "
                             "speculate with a draft model (STANDALONE)")
        self.model = model
        self.layer = layers[0]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        embed = getattr(self.layer, "embed_tokens", None) or self.model.model.embed_tokens
        return embed(ids)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        head = getattr(self.layer.shared_head, "head", None) or self.model.lm_head
        return head(hidden)

    def rows(self, hidden: torch.Tensor, next_ids: list[int] | torch.Tensor, start: int = 0,
             state: MTPDraftState | None = None) -> torch.Tensor:
        """The layer's output after ``shared_head.norm`` for rows ``start ..`` (``hidden`` ``[m, H]``, ``next_ids``
        their ``x[i + 1]``), ``[m, H]``; after ``state``'s cache when given (the rows join it), else uncached.
        Differentiable (the engine calls it under ``torch.no_grad``)."""
        from transformers import DynamicCache
        from transformers.masking_utils import create_causal_mask

        layer, model = self.layer, self.model
        cache = None
        if state is not None:
            if state.cache is None:
                state.cache = DynamicCache(config=layer.mtp_config)
            cache = state.cache
        ids = torch.as_tensor(next_ids, dtype=torch.long, device=hidden.device).reshape(1, -1)
        x = layer.eh_proj(torch.cat([layer.enorm(self._embed(ids)), layer.hnorm(hidden.unsqueeze(0))], dim=-1))
        positions = torch.arange(start, start + x.shape[1], device=x.device).unsqueeze(0)
        mask = create_causal_mask(config=layer.mtp_config, inputs_embeds=x, attention_mask=None,
                                  past_key_values=cache, position_ids=positions)
        out = layer(x, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=cache is not None,
                    position_embeddings=model.model.rotary_emb(x, position_ids=positions))
        out = out[0] if isinstance(out, tuple) else out
        return layer.shared_head.norm(out)[0]

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft logits of output rows (float32)."""
        return self._head(normed).float()

    def _rows(self, state: MTPDraftState, hidden: torch.Tensor, next_ids: list[int], start: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.rows(hidden, next_ids, start, state)[-1]
        return self.logits(normed), normed

    def draft(self, state: MTPDraftState, hidden: torch.Tensor, seq: list[int], k: int,
              choose: Any) -> list[int]:
        """``k`` draft tokens after ``seq`` (its last token not yet fed to the served model), ``hidden`` ``[len(seq)
        - 1, H]`` the served model's final hidden states of the fed positions; ``choose(logits) -> token`` picks each
        (greedy or sampled by the caller). The cache keeps the rows of ``hidden`` only."""
        known = hidden.shape[0]
        if known != len(seq) - 1:
            raise ValueError(f"MTP draft: {known} hidden states for {len(seq)} tokens (one per fed token expected)")
        if state.rows > known:  # the served model's cache was cut below the rows held (a new request's state)
            state.cache.crop(known)
            state.rows = known
        row, out = self._rows(state, hidden[state.rows:], list(seq[state.rows + 1:]), state.rows)
        state.rows = known
        tokens = [choose(row)]
        for position in range(known, known + k - 1):
            row, out = self._rows(state, out.unsqueeze(0), [tokens[-1]], position)
            tokens.append(choose(row))
        state.cache.crop(known)
        return tokens

    def step(self, hidden: torch.Tensor, next_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One uncached draft step over rows ``0..n-1``: the last row's logits and output hidden state (the reference
        :meth:`draft` must agree with)."""
        normed = self.rows(hidden, next_ids)[-1]
        return self.logits(normed), normed

"""The tiny GLM-5 with a multi-token-prediction (MTP) layer, as an HF checkpoint.

GLM-5's checkpoint stores its MTP layer after the decoder layers, as ``model.layers.<num_hidden_layers>.*``: a
decoder layer of the model's kind (MLA, a DSA indexer of its own, MoE) plus ``enorm`` / ``hnorm`` / ``eh_proj`` /
``shared_head.norm``, and ``config.num_nextn_predict_layers`` counts them. transformers builds no MTP layer, so
:func:`save_tiny_glm5_with_mtp` draws the tiny GLM-5 (:mod:`slime_ascend.glm5.tiny`) with one layer more, saves it, then gives that
last layer the MTP layer's name and extra tensors (norms at one, ``eh_proj`` drawn like a linear) and the config
its real layer count: the layout slime's GLM-5 converters read (``hf_to_megatron/deepseek.py``: ``mtp.layers.0`` is
``model.layers.<num_hidden_layers>``) and the torch engine holds (``rollout.torch_engine.mtp``).

:func:`make_next_token_confident` then gives such a checkpoint a confident next token that its MTP layer predicts
as the model does: what a trained GLM-5 and its trained MTP layer are, and what slime's ``--ci-test`` bounds
presuppose (a rollout's mean log-prob in (-1, 0), its entropy in (0, 1), the MTP loss below 1.0), which the random
tiny GLM-5 (about ln 1024 nats a token) cannot meet.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...glm5.tiny import NUM_LAYERS, TINY_GLM5_KWARGS

__all__ = ["make_next_token_confident", "save_tiny_glm5_with_mtp", "writes_to_residual"]


def save_tiny_glm5_with_mtp(out_dir: str | Path, seed: int = 0, layers: int = NUM_LAYERS) -> Path:
    """The tiny GLM-5 drawn from ``seed`` (fp32, ``layers`` decoder layers: its own 4 by default) with one MTP layer
    and the byte tokenizer, as an HF directory; returns it (an existing one is kept)."""
    import torch
    from safetensors.torch import load_file, save_file

    from .model import build_byte_tokenizer, load_model, save_model

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    total = layers + 1
    per_layer = {"mlp_layer_types": ["dense"] + ["sparse"] * (total - 1),
                 "indexer_types": (["full", "shared"] * total)[: total - 1] + ["full"]}  # the MTP layer: own indexer
    model = load_model(None, dtype=torch.float32, seed=seed, glm5=True,
                       config_overrides={"num_hidden_layers": total, **per_layer})
    save_model(model, out, build_byte_tokenizer())
    config = json.loads((out / "config.json").read_text())
    for name, value in list(config.items()):  # the per-layer lists back to the decoder layers
        if isinstance(value, list) and len(value) == total:
            config[name] = value[:layers]
    config.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    hidden = int(TINY_GLM5_KWARGS["hidden_size"])
    generator = torch.Generator().manual_seed(seed + 7919)
    prefix = f"model.layers.{layers}."
    for path in out.glob("*.safetensors"):
        state = load_file(str(path))
        if not any(name.startswith(prefix) for name in state):
            continue
        state[prefix + "enorm.weight"] = torch.ones(hidden)
        state[prefix + "hnorm.weight"] = torch.ones(hidden)
        state[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.02
        state[prefix + "shared_head.norm.weight"] = torch.ones(hidden)
        save_file(state, str(path), metadata={"format": "pt"})
    return out


def writes_to_residual(name: str, last_layer: int) -> bool:
    """Whether checkpoint tensor ``name`` writes to the residual stream (attention's ``o_proj``, the MLPs' and experts'
    ``down_proj``) in a layer up to ``last_layer`` (``model.layers.<i>.*``, ``i <= last_layer``)."""
    parts = name.split(".")
    return (len(parts) > 3 and parts[1] == "layers" and int(parts[2]) <= last_layer
            and (name.endswith("o_proj.weight") or name.endswith("down_proj.weight")))


def make_next_token_confident(checkpoint: str | Path, margin: float = 14.0, residual_scale: float = 0.02,
                              seed: int = 0, mtp_agrees: bool = True) -> Path:
    """Rewrite the MTP checkpoint ``checkpoint`` (from :func:`save_tiny_glm5_with_mtp`, in place) so that the model
    and its MTP layer are confident and agree; returns it.

    * Each token ``x`` gets a successor ``succ(x)`` (a permutation drawn from ``seed``), and ``lm_head`` row
      ``succ(x)`` is ``x``'s embedding, scaled so that the final norm of ``x``'s embedding scores it ``margin``: the
      model's next token, from the current one, scores ``margin`` where the others score about ``margin`` times a
      random cosine (``N(0, 1/hidden)``).
    * Every decoder layer's writes to the residual stream (attention's ``o_proj``, the MLPs' and experts'
      ``down_proj``) scaled by ``residual_scale``: the context still moves every logit (MLA, DSA, MoE all matter to
      the log-probs), but the current token leads.
    * ``mtp_agrees``: the MTP layer's writes scaled too, and its ``eh_proj`` passes the next token's normed embedding
      through (its hidden-state half zero), so that its head scores ``succ(next)``: the token after next, as the
      model will. Without it the MTP layer stays as drawn (for a benchmark that trains it to agree).

    Measured on the tiny GLM-5 of seed 0, 16 of slime's chat-templated demo prompts x 16 tokens sampled at temperature
    1 by the torch engine (a sampled token's mean log-prob; the MTP layer's cross-entropy on the tokens after next):
    at the defaults -0.056 and 0.056 nats; at margin 14, residual scale 0.05, -0.16 and 0.165 (a few positions where
    the context outweighs the current token cost 10 to 14 nats each); at margin 12 with 0.01, -0.29 and 0.29.
    """
    import torch
    from safetensors.torch import load_file, save_file

    out = Path(checkpoint)
    config = json.loads((out / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    if int(config.get("num_nextn_predict_layers") or 0) != 1:
        raise ValueError(f"{out}: num_nextn_predict_layers is not 1; make it with save_tiny_glm5_with_mtp first")
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    states = {path: load_file(str(path)) for path in sorted(out.glob("*.safetensors"))}
    embed = next(state[name] for state in states.values() if (name := "model.embed_tokens.weight") in state).float()
    successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 104729))
    # final norm (weight one) of e is e / rms(e) = sqrt(hidden) * unit(e): a row unit(e) * margin / sqrt(hidden)
    # scores it margin
    unit = embed / embed.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # a padding row of zeros stays zero
    head = torch.empty_like(embed)
    head[successor] = unit * (margin / hidden ** 0.5)
    prefix = f"model.layers.{layers}."
    for path, state in states.items():
        for name in list(state):
            if name == "lm_head.weight":
                state[name] = head.to(state[name].dtype)
            elif name == prefix + "eh_proj.weight" and mtp_agrees:
                through = torch.zeros(hidden, 2 * hidden)
                through[:, :hidden] = torch.eye(hidden)  # [enorm(embedding of the next token) | hnorm(hidden)]
                state[name] = through.to(state[name].dtype)
            elif writes_to_residual(name, layers if mtp_agrees else layers - 1):
                state[name] = state[name] * residual_scale
        save_file(state, str(path), metadata={"format": "pt"})
    return out

"""The tiny GLM-5 with a multi-token-prediction (MTP) layer, as an HF checkpoint.

GLM-5's checkpoint stores its MTP layer after the decoder layers, as ``model.layers.<num_hidden_layers>.*``: a
decoder layer of the model's kind (MLA, a DSA indexer of its own, MoE) plus ``enorm`` / ``hnorm`` / ``eh_proj`` /
``shared_head.norm``, and ``config.num_nextn_predict_layers`` counts them. transformers builds no MTP layer, so
:func:`save_tiny_glm5_with_mtp` draws the tiny GLM-5 (:mod:`slime_ascend.glm5.tiny`) with one layer more, saves it, then gives that
last layer the MTP layer's name and extra tensors (norms at one, ``eh_proj`` drawn like a linear) and the config
its real layer count: the layout slime's GLM-5 converters read (``hf_to_megatron/deepseek.py``: ``mtp.layers.0`` is
``model.layers.<num_hidden_layers>``) and the torch engine holds (``rollout.torch_engine.mtp``).
"""

from __future__ import annotations

import json
from pathlib import Path

from ...glm5.tiny import NUM_LAYERS, TINY_GLM5_KWARGS

__all__ = ["save_tiny_glm5_with_mtp"]


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

"""A tiny Qwen3-shaped HF checkpoint for the weight-sync tests."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import torch
from safetensors.torch import save_file

H, HEADS, KV, HD, FFN, VOCAB = 256, 4, 2, 64, 384, 320


def hf_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    out = {"model.embed_tokens.weight": r(VOCAB, H), "model.norm.weight": r(H), "lm_head.weight": r(VOCAB, H)}
    for i in range(2):
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": r(HEADS * HD, H), p + "self_attn.k_proj.weight": r(KV * HD, H),
            p + "self_attn.v_proj.weight": r(KV * HD, H), p + "self_attn.o_proj.weight": r(H, HEADS * HD),
            p + "self_attn.q_norm.weight": r(HD), p + "self_attn.k_norm.weight": r(HD),
            p + "mlp.gate_proj.weight": r(FFN, H), p + "mlp.up_proj.weight": r(FFN, H),
            p + "mlp.down_proj.weight": r(H, FFN), p + "input_layernorm.weight": r(H),
            p + "post_attention_layernorm.weight": r(H),
        })
    out["model.layers.1.mlp.down_proj.weight"][:128, :128] = 0  # an all-zero FP8 block / INT groups
    return out


def write_hf(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": H,
              "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD, "intermediate_size": FFN,
              "num_hidden_layers": 2, "vocab_size": VOCAB, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6}
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer_config.json").write_text("{}")
    return path


def plugin_for(fmt: str) -> str:
    return {"fp8-block": "fp8-sync", "int8-w8a8": "int8-sync", "int8-ct": "int8-sync", "int4-group": "int4-sync",
            "mxfp8": "mxfp8-sync"}[fmt]


def sync_args(plugin: str, hf_checkpoint, **extra) -> Namespace:
    ns = Namespace(ascend_plugins=plugin, hf_checkpoint=str(hf_checkpoint))
    for k, v in extra.items():
        setattr(ns, k, v)
    return ns


def quant_config(path: Path):
    return json.loads((path / "config.json").read_text()).get("quantization_config")

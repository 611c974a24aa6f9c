"""Offline converter on a tiny random HF Qwen3, bit-exact verify, dequantised loading."""

from __future__ import annotations

import json
import os
import shutil
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import need
from slime_ascend.quant import (
    FORMATS, convert_checkpoint, format_from_checkpoint, load_state_dict_dequantized, quantize_named_params,
    spec_from_checkpoint, verify_against_checkpoint, verify_named_tensors, verify_tensor,
)
from slime_ascend.quant.checkpoint import CheckpointReader

transformers = need("transformers")


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    cfg = transformers.Qwen3Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(d, safe_serialization=True, max_shard_size="300KB")
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    (d / "tokenizer.json").write_text("{}")
    (d / "chat_template.jinja").write_text("{{ messages }}")
    return d


def _source(d) -> dict[str, torch.Tensor]:
    with CheckpointReader(d) as r:
        return dict(r.items())


@pytest.mark.parametrize("fmt", FORMATS)
def test_convert_verify_load(fmt, tiny_qwen3, tmp_path):
    out = tmp_path / fmt
    rep = convert_checkpoint(tiny_qwen3, out, fmt, max_shard_bytes=200_000)
    src = _source(tiny_qwen3)
    assert "model.layers.0.self_attn.q_proj.weight" in rep.quantized
    assert "model.embed_tokens.weight" in rep.kept and "lm_head.weight" in rep.kept
    assert len(rep.quantized) == 14  # 7 linear projections x 2 layers
    files = set(os.listdir(out))
    assert {"tokenizer_config.json", "tokenizer.json", "chat_template.jinja", "config.json"} <= files
    cfg = json.loads((out / "config.json").read_text())
    ascend = {"int8-w8a8": ("W8A8_DYNAMIC", "weight_offset"), "mxfp8": ("W8A8_MXFP8", "weight_scale")}
    if fmt in ascend:
        qtype, extra = ascend[fmt]
        assert "quantization_config" not in cfg
        desc = json.loads((out / "quant_model_description.json").read_text())
        assert desc["model.layers.0.mlp.down_proj.weight"] == qtype
        assert desc[f"model.layers.0.mlp.down_proj.{extra}"] == qtype
        assert desc["model.norm.weight"] == "FLOAT" and desc["model_quant_type"] == qtype
        assert any(f.startswith("quant_model_weights") and f.endswith(".safetensors") for f in files)
        assert "quant_model_weights.safetensors.index.json" in files
    else:
        assert "quantization_config" in cfg
        assert "model.safetensors.index.json" in files
        assert "lm_head" in (cfg["quantization_config"].get("ignore")
                             or cfg["quantization_config"].get("modules_to_not_convert"))
    assert format_from_checkpoint(out) == fmt
    # the index covers every tensor, the shards load with plain safetensors
    prefix = "quant_model_weights" if fmt in ascend else "model"
    index = json.loads((out / f"{prefix}.safetensors.index.json").read_text())
    loaded = {}
    for f in set(index["weight_map"].values()):
        loaded.update(load_file(out / f))
    assert set(loaded) == set(index["weight_map"])
    # online quantisation of the same BF16 weights reproduces the files bit for bit
    report = verify_against_checkpoint(out, tiny_qwen3)
    assert report.ok, report.summary()
    assert report.checked == len(loaded)
    # ... and as a sync bucket of HF-named params
    bucket = quantize_named_params([(k, src[k]) for k in list(src)[:6]], spec_from_checkpoint(out))
    assert verify_named_tensors(out, bucket).ok
    # dequantised loading returns every original name, close to the source
    deq = load_state_dict_dequantized(out, dtype=torch.float32)
    assert set(deq) == set(src)
    for k, v in src.items():
        assert deq[k].dtype == torch.float32 and deq[k].shape == v.shape
        # mxfp8: OCP saturates |x| / scale in (448, 512) to 448, up to 1/8 of the block's amax
        rel = {"int4-group": 0.2, "mxfp8": 0.13}.get(fmt, 0.07) if k in rep.quantized else 0.07
        tol = rel * float(v.float().abs().max())
        if k in rep.quantized:
            assert (deq[k] - v.float()).abs().max() <= tol, k
        else:
            assert torch.equal(deq[k], v.float()), k


def test_verify_detects_tampering(tiny_qwen3, tmp_path):
    out = tmp_path / "fp8"
    convert_checkpoint(tiny_qwen3, out, "fp8-block")
    name = "model.layers.1.mlp.up_proj.weight"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard = out / index["weight_map"][name]
    tensors = load_file(shard)
    t = tensors[name].view(torch.uint8).clone()
    t.view(-1)[7] ^= 1
    tensors[name] = t.view(torch.float8_e4m3fn)
    save_file(tensors, shard, metadata={"format": "pt"})
    report = verify_against_checkpoint(out, tiny_qwen3)
    assert not report.ok
    assert [m.name for m in report.mismatches] == [name]
    assert "1 bytes differ" in report.summary()
    src = _source(tiny_qwen3)
    good = dict(quantize_named_params([(name, src[name])], "fp8-block"))
    assert not verify_tensor(out, name, good[name]).ok
    assert verify_tensor(out, name.replace("weight", "weight_scale_inv"),
                         good[name.replace("weight", "weight_scale_inv")]).ok
    assert "dtype" in verify_tensor(out, name, good[name].float()).reason
    assert verify_tensor(out, "nope.weight", good[name]).reason == "not in checkpoint"


def test_verify_reports_missing_and_unsynced(tiny_qwen3, tmp_path):
    out = tmp_path / "int8"
    convert_checkpoint(tiny_qwen3, out, "int8-ct")
    src = _source(tiny_qwen3)
    pairs = [(k, v) for k, v in src.items() if "layers.0." in k]
    rep = verify_against_checkpoint(out, pairs)
    assert not rep.ok and rep.not_synced and not rep.mismatches
    assert verify_against_checkpoint(out, pairs, require_all=False).ok
    rep2 = verify_named_tensors(out, [("extra.weight", torch.zeros(2))])
    assert not rep2.ok and rep2.missing_in_checkpoint == ["extra.weight"]


def test_converter_refuses_bad_inputs(tiny_qwen3, tmp_path):
    with pytest.raises(ValueError, match="one of"):
        convert_checkpoint(tiny_qwen3, tmp_path / "x", "int3")
    out = tmp_path / "y"
    convert_checkpoint(tiny_qwen3, out, "int8-ct")
    with pytest.raises(ValueError, match="already quantised"):
        convert_checkpoint(out, tmp_path / "z", "fp8-block")
    with pytest.raises(ValueError, match="not empty"):
        convert_checkpoint(tiny_qwen3, out, "int8-ct")
    pt_only = tmp_path / "pt"
    pt_only.mkdir()
    (pt_only / "config.json").write_text("{}")
    (pt_only / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match="safetensors"):
        convert_checkpoint(pt_only, tmp_path / "w", "int8-ct")



def test_converter_refuses_a_link_out_of_hf_dir_before_writing(tiny_qwen3, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(tiny_qwen3, src)
    (tmp_path / "secret").write_text("only mine")
    (src / "chat_template.jinja").unlink()
    (src / "chat_template.jinja").symlink_to(tmp_path / "secret")
    with pytest.raises(ValueError, match=r"hf_dir file .*chat_template.jinja' is a link to .*secret', outside hf_dir"):
        convert_checkpoint(src, tmp_path / "q", "int8-ct")
    assert not (tmp_path / "q").exists()


def test_outputs_are_no_wider_than_their_sources(tiny_qwen3, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(tiny_qwen3, src)
    shards = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    assert len(shards) > 1
    for f in shards:
        os.chmod(src / f, 0o644)
    os.chmod(src / shards[-1], 0o640)  # one shard is not world-readable: no output weight file is
    os.chmod(src / "config.json", 0o600)
    os.chmod(src / "tokenizer.json", 0o440)
    old = os.umask(0o022)
    try:
        convert_checkpoint(src, tmp_path / "q", "int8-ct", max_shard_bytes=200_000)
    finally:
        os.umask(old)
    modes = {f: stat.S_IMODE(os.stat(tmp_path / "q" / f).st_mode) for f in os.listdir(tmp_path / "q")}
    weights = {f: m for f, m in modes.items() if f.startswith("model")}
    assert len(weights) > 2 and set(weights.values()) == {0o640}  # shards and index
    assert modes["config.json"] == 0o600 and modes["tokenizer.json"] == 0o440
    assert modes["tokenizer_config.json"] == 0o644 and modes["chat_template.jinja"] == 0o644


def test_a_fifo_shard_is_refused_without_opening_it(tmp_path):
    import threading

    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text("{}")
    os.mkfifo(d / "model.safetensors")
    raised: list[Exception] = []

    def read():
        try:
            CheckpointReader(d)
        except ValueError as exc:
            raised.append(exc)

    worker = threading.Thread(target=read, daemon=True)
    worker.start()
    worker.join(10)
    assert raised and "model.safetensors' is not a regular file" in str(raised[0]), "blocked or read"


def test_nan_weight_fails_conversion_naming_tensor(tiny_qwen3, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(tiny_qwen3):
        p = tiny_qwen3 / f
        if f.endswith(".safetensors"):
            ts = load_file(p)
            if "model.layers.1.self_attn.k_proj.weight" in ts:
                ts["model.layers.1.self_attn.k_proj.weight"][3, 3] = float("nan")
            save_file(ts, bad / f, metadata={"format": "pt"})
        else:
            (bad / f).write_bytes(p.read_bytes())
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_proj.weight"):
        convert_checkpoint(bad, tmp_path / "o", "fp8-block")


def _with_value(src, dst, name, value):
    dst.mkdir()
    for f in os.listdir(src):
        p = src / f
        if f.endswith(".safetensors"):
            ts = load_file(p)
            if name in ts:
                ts[name].view(-1)[3] = value
            save_file(ts, dst / f, metadata={"format": "pt"})
        else:
            (dst / f).write_bytes(p.read_bytes())
    return dst


@pytest.mark.parametrize("name,value", [("model.norm.weight", float("nan")),
                                        ("model.embed_tokens.weight", float("inf")),
                                        ("model.layers.0.self_attn.k_proj.weight", float("nan"))])
def test_non_finite_tensor_refused_and_previous_output_kept(name, value, tiny_qwen3, tmp_path):
    out = tmp_path / "o"
    convert_checkpoint(tiny_qwen3, out, "int4-group")
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    bad = _with_value(tiny_qwen3, tmp_path / "bad", name, value)
    with CheckpointReader(bad) as r:
        fname = r.file_of[name]
    with pytest.raises(ValueError, match=rf"bad/{fname}: {name}: \w+ contains NaN or inf"):
        convert_checkpoint(bad, out, "int4-group", overwrite=True)
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["bad", "o"]


def test_unquantised_checkpoint_loads_as_is(tiny_qwen3):
    deq = load_state_dict_dequantized(tiny_qwen3, dtype=torch.float32)
    src = _source(tiny_qwen3)
    assert all(torch.equal(deq[k], v.float()) for k, v in src.items())


@pytest.mark.parametrize("fmt", ["int8-ct", "int4-group"])
def test_ct_checkpoint_loads_in_transformers(fmt, tiny_qwen3, tmp_path):
    """transformers + compressed-tensors load our checkpoint and decompress it to our values."""
    need("compressed_tensors")
    out = tmp_path / "ct"
    convert_checkpoint(tiny_qwen3, out, fmt)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, torch_dtype=torch.bfloat16, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False))
    sd = model.state_dict()
    deq = load_state_dict_dequantized(out, dtype=torch.bfloat16)
    w = sd["model.layers.0.mlp.down_proj.weight"]
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, deq["model.layers.0.mlp.down_proj.weight"])

"""qat at tensor parallelism 2 (two gloo processes, ``qat_tp_worker.py``): the tiny Qwen3 (row-parallel shards of
input dim 32 and 64, int4 groups of 32) loaded by slime's HF->Megatron conversion, DDP-wrapped, hooked as the plugin
hooks it. Each rank's fake quant, gathered over TP as slime gathers for the weight sync, is the exporter's int4
weights of the gathered master weight bit for bit (the group boundaries of a shard are the gathered weight's); the
forward under the hooks is a forward at those weights (equal log-probs to a model holding them), the gradient is the
straight-through one (the master weights get the gradient at the quantised weights); the int4 export's own forward
(transformers on ``slime-ascend quantize --format int4-group`` of the checkpoint) agrees with the TP 2 QAT log-probs.
And the layout a shard would cut a group in is refused at parse_args."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import zygote

from conftest import need

pytestmark = pytest.mark.slime

need("megatron.core")

HERE = Path(__file__).parent
GROUP = 32
sys.path.insert(0, str(HERE.parent / "cpu"))
from spec_tp_worker import batch_log_probs, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("qat-tp")
    tiny_model().save_pretrained(str(root / "model"), safe_serialization=True)
    out = root / "tp2"
    from qat_tp_worker import run

    zygote.spawn(run, args=(2, zygote.free_port(), str(root / "model"), GROUP, str(out)), nprocs=2,
                 env={**os.environ, "SLIME_ASCEND_PLUGINS": "cpu", "OMP_NUM_THREADS": "1"}, timeout=600)
    return root, [torch.load(f"{out}.{rank}.pt") for rank in range(2)]


def test_each_shards_fake_quant_is_the_exporters_on_the_gathered_weight(tp2):
    _, ranks = tp2
    for rank, got in enumerate(ranks):
        assert got["hooked"] == sorted(f"module.module.decoder.layers.{i}.{s}" for i in range(2) for s in (
            "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight", "mlp.linear_fc1.weight",
            "mlp.linear_fc2.weight")), rank
        flat = {hf: v for per in got["exporter"].values() for hf, v in per.items()}
        assert len(flat) == 2 * 7, flat.keys()  # q, k, v, o, gate, up, down of both layers
        assert all(same for same, _ in flat.values()), (rank, flat)
        assert all(quantised for _, quantised in flat.values()), (rank, flat)


def test_the_hooked_forward_and_backward_are_at_the_quantised_weights(tp2):
    _, ranks = tp2
    for rank, got in enumerate(ranks):
        assert torch.equal(got["log_probs"], got["baked_log_probs"]), rank
        assert (got["log_probs"] - got["plain_log_probs"]).abs().max() > 1e-3, rank  # int4 moves them
        assert got["grads"].keys() == got["baked_grads"].keys()
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, got["baked_grads"][name], rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
            assert grad.abs().max() > 0, name


def test_the_int4_exports_forward_agrees_with_tp2_qat(tp2):
    from slime_ascend.rollout.torch_engine.model import load_model

    root, ranks = tp2
    out = root / "int4"
    done = subprocess.run([sys.executable, "-m", "slime_ascend.cli", "quantize", str(root / "model"), str(out),
                           "--format", "int4-group", "--group-size", str(GROUP)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    with torch.no_grad():
        log_probs = batch_log_probs(load_model(out, torch.float32))
    for got in ranks:
        torch.testing.assert_close(got["log_probs"], log_probs, rtol=0, atol=2e-5)


def _args(**over):
    base = dict(tensor_model_parallel_size=1, hidden_size=64, num_attention_heads=4, kv_channels=16,
                ffn_hidden_size=96, num_experts=None, gradient_accumulation_fusion=False, hf_checkpoint=None,
                ascend_plugins=["qat"])
    return types.SimpleNamespace(**{**base, **over})


SETTINGS = {"ascend_qat_format": "int4-group", "ascend_qat_group_size": 32, "ascend_qat_numerics": None}


def test_a_layout_that_cuts_a_group_is_refused_at_parse_args():
    from slime_ascend.plugins.settings import SettingsError
    from slime_ascend.qat.spec import validate

    validate(_args(), SETTINGS)  # ffn 96 whole: 3 groups
    with pytest.raises(SettingsError, match=r"mlp.linear_fc2: its TP shard's input dim 48 \(= 96 / TP\) is not a "
                                            r"multiple of the int4 group size 32"):
        validate(_args(tensor_model_parallel_size=2), SETTINGS)
    validate(_args(tensor_model_parallel_size=2, ffn_hidden_size=128), SETTINGS)
    with pytest.raises(SettingsError, match="self_attention.linear_proj"):
        validate(_args(tensor_model_parallel_size=4, ffn_hidden_size=128), SETTINGS)
    with pytest.raises(SettingsError, match="mlp.experts.linear_fc2"):
        validate(_args(tensor_model_parallel_size=2, ffn_hidden_size=128, num_experts=4, moe_ffn_hidden_size=32),
                 SETTINGS)
    with pytest.raises(SettingsError, match="fp8-block fake quant is supported at tensor .* parallel size 1"):
        validate(_args(tensor_model_parallel_size=2, ffn_hidden_size=128), {**SETTINGS, "ascend_qat_format": "fp8-block"})
    with pytest.raises(SettingsError, match="--no-gradient-accumulation-fusion"):
        validate(_args(gradient_accumulation_fusion=True), SETTINGS)

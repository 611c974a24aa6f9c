"""Real slime: after the runtime patch, slime's own Megatron->HF conversion sends exactly what the
offline converter writes (names and bytes), for every format; removal restores slime; a disk
sync written with slime's shard writer passes verify-quant; slime's FP8 zero-block cases hold."""

from __future__ import annotations

import importlib.util
import sys
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "weight_sync"))
from _ws_helpers import FFN, HD, HEADS, KV, VOCAB, H, plugin_for, quant_config, write_hf  # noqa: E402

pytestmark = pytest.mark.slime

FORMATS = ("fp8-block", "int8-w8a8", "int8-ct", "int4-group")


def megatron_params(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    out = {
        "module.module.embedding.word_embeddings.weight": r(VOCAB, H),
        "module.module.decoder.final_layernorm.weight": r(H),
        "module.module.output_layer.weight": r(VOCAB, H),
    }
    for i in range(2):
        p = f"module.module.decoder.layers.{i}."
        out.update({
            p + "self_attention.linear_qkv.weight": r((HEADS + 2 * KV) * HD, H),
            p + "self_attention.linear_proj.weight": r(H, HEADS * HD),
            p + "self_attention.linear_qkv.layer_norm_weight": r(H),
            p + "self_attention.q_layernorm.weight": r(HD),
            p + "self_attention.k_layernorm.weight": r(HD),
            p + "mlp.linear_fc1.weight": r(2 * FFN, H),
            p + "mlp.linear_fc2.weight": r(H, FFN),
            p + "mlp.linear_fc1.layer_norm_weight": r(H),
        })
    out["module.module.decoder.layers.1.mlp.linear_fc2.weight"][:128, :128] = 0  # all-zero block
    return out


def slime_args(**extra) -> Namespace:
    ns = Namespace(hidden_size=H, num_attention_heads=HEADS, num_query_groups=KV, kv_channels=HD,
                   vocab_size=VOCAB, q_lora_rank=None)
    for k, v in extra.items():
        setattr(ns, k, v)
    return ns


@pytest.fixture(scope="module")
def m2h():
    from slime.backends.megatron_utils import megatron_to_hf

    return megatron_to_hf


@pytest.fixture(scope="module")
def world(m2h, tmp_path_factory):
    """Megatron params -> HF tensors by slime's own (unpatched) conversion -> offline checkpoints."""
    from slime_ascend.quant.checkpoint import convert_checkpoint

    params = megatron_params()
    args = slime_args()
    hf = {}
    for name, p in params.items():
        for hf_name, t in m2h.convert_to_hf(args, "qwen3", name, p, None):
            hf[hf_name] = t.contiguous().clone()
    root = tmp_path_factory.mktemp("wss")
    write_hf(root / "hf", hf)
    dirs = {"hf": root / "hf"}
    for fmt in FORMATS:
        convert_checkpoint(root / "hf", root / fmt, fmt)
        dirs[fmt] = root / fmt
    return params, dirs


@pytest.fixture
def installed(fresh_runtime):
    from slime_ascend import patch
    from slime_ascend.weight_sync import funnel, metrics

    funnel.clear_caches()
    metrics.reset()
    yield
    for pid in ("train.quantize_params", "train.quant_post_process", "train.weight_sync_metrics"):
        patch.get(pid).remove()
    funnel.clear_caches()
    metrics.reset()


def _init(fmt, dirs, **extra):
    from slime_ascend import hooks
    from slime_ascend.startup import early

    args = slime_args(ascend_plugins=plugin_for(fmt), hf_checkpoint=str(dirs[fmt]), **extra)
    early.validate_now(args, "train")  # as TrainRayActor.init starts: validation, then the declared train patches
    hooks.megatron_init(args)  # the plugin's megatron_init: the format check
    return args


@pytest.mark.parametrize("fmt", FORMATS)
def test_slime_conversion_sends_offline_bytes(fmt, world, m2h, installed):
    from slime_ascend import patch
    from slime_ascend.quant.checkpoint import CheckpointReader, tensors_bit_equal

    params, dirs = world
    args = _init(fmt, dirs)
    assert patch.get("train.quantize_params").applied
    qc = quant_config(dirs[fmt])  # what slime's actor reads from --hf-checkpoint (None for Ascend)
    reader = CheckpointReader(dirs[fmt])
    seen = {}
    for name, p in params.items():
        for hf_name, t in m2h.convert_to_hf(args, "qwen3", name, p, qc):
            assert hf_name not in seen
            seen[hf_name] = t
            assert hf_name in reader, hf_name
            assert tensors_bit_equal(t, reader.get(hf_name)), hf_name
    assert set(seen) == set(reader.keys())
    assert seen["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert seen["lm_head.weight"].dtype == torch.bfloat16
    assert seen["model.norm.weight"].dtype == torch.bfloat16


def test_removal_restores_slime(world, m2h, installed):
    from slime_ascend import patch

    params, dirs = world
    original = m2h.quantize_params
    _init("int8-w8a8", dirs)
    assert m2h.quantize_params is not original
    name = "module.module.decoder.layers.0.mlp.linear_fc1.weight"
    args = slime_args(ascend_plugins="int8-sync", hf_checkpoint=str(dirs["int8-w8a8"]))
    assert {t.dtype for _, t in m2h.convert_to_hf(args, "qwen3", name, params[name], None)} != {torch.bfloat16}
    patch.get("train.quantize_params").remove()
    assert m2h.quantize_params is original
    out = m2h.convert_to_hf(args, "qwen3", name, params[name], None)
    assert [n for n, _ in out] == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    assert all(t.dtype == torch.bfloat16 for _, t in out)


def test_wrong_engine_checkpoint_fails_at_megatron_init(world, installed):
    from slime_ascend import hooks
    from slime_ascend.plugins.settings import SettingsError

    _, dirs = world
    with pytest.raises(SettingsError, match="--format fp8-block"):
        hooks.megatron_init(slime_args(ascend_plugins="fp8-sync", hf_checkpoint=str(dirs["int8-ct"])))


def test_disk_sync_dir_passes_verify_quant(world, m2h, installed, tmp_path, capsys):
    """A disk sync as UpdateWeightFromDisk writes it (slime's shard writer and finalizer)."""
    from slime.backends.megatron_utils import hf_checkpoint_saver as saver

    from slime_ascend.quant.cli import main_verify

    params, dirs = world
    args = _init("int8-ct", dirs)
    qc = quant_config(dirs["int8-ct"])
    out_dir = tmp_path / "weight_v000001"
    out_dir.mkdir()
    writer = saver._SafetensorShardWriter(out_dir, enabled=True)
    items = list(params.items())
    for idx, chunk in enumerate((items[: len(items) // 2], items[len(items) // 2:])):
        named = [x for name, p in chunk for x in m2h.convert_to_hf(args, "qwen3", name, p, qc)]
        writer.write(named, shard_idx=idx)
    saver._finalize_local_shards(out_dir, writer.state(), [writer.state()], write_index=True)
    assert main_verify([str(dirs["int8-ct"]), str(out_dir)]) == 0
    assert "OK:" in capsys.readouterr().out
    # a differing sync fails, naming the tensor
    bad = tmp_path / "bad.safetensors"
    from safetensors.torch import save_file

    name = "model.layers.0.mlp.up_proj.weight"
    t = dict(m2h.convert_to_hf(args, "qwen3", "module.module.decoder.layers.0.mlp.linear_fc1.weight",
                               params["module.module.decoder.layers.0.mlp.linear_fc1.weight"] * 1.01, qc))[name]
    save_file({name: t.contiguous()}, str(bad))
    assert main_verify([str(dirs["int8-ct"]), str(bad)]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_pop_metrics_reports_sync(world, m2h, installed):
    from slime.backends.megatron_utils.update_weight.update_weight_from_disk import UpdateWeightFromDisk

    params, dirs = world
    args = _init("fp8-block", dirs)
    qc = quant_config(dirs["fp8-block"])
    sent = 0
    for name, p in params.items():
        sent += sum(t.numel() * t.element_size() for _, t in m2h.convert_to_hf(args, "qwen3", name, p, qc))
    updater = object.__new__(UpdateWeightFromDisk)
    updater.update_weight_metrics = {"perf/slime_own": 1.0}
    m = updater.pop_metrics()
    assert m["perf/slime_own"] == 1.0
    assert m["perf/weight_sync_bytes"] == sent
    assert m["perf/weight_sync_quantized_params"] == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert m["perf/weight_sync_quant_time"] > 0 and m["perf/weight_sync_quant_gbps"] > 0
    assert updater.pop_metrics() == {}


class _Engine:
    def __init__(self, log):
        self.log = log

    def __getattr__(self, name):
        log = self.log

        def call(**kw):
            log.append((name, kw.get("restore_weights_before_load"), kw.get("post_process_quantization")))

        return SimpleNamespace(remote=call)


@pytest.mark.parametrize("fmt,expect_post_process", [("int8-w8a8", True), ("int8-ct", True), ("fp8-block", False)])
def test_engine_post_process_gate(fmt, expect_post_process, world, installed, monkeypatch):
    """UpdateWeightFromDistributed.update_weights (ray / dist stubbed): the engines are asked to
    restore and re-process around the transfer for int8 (Ascend via our gate, CT via slime's)."""
    from slime.backends.megatron_utils.update_weight import update_weight_from_distributed as mod

    _, dirs = world
    args = _init(fmt, dirs)
    monkeypatch.setattr(mod, "dist", SimpleNamespace(get_rank=lambda: 0, barrier=lambda **kw: None))
    monkeypatch.setattr(mod, "get_gloo_group", lambda: None)
    monkeypatch.setattr(mod, "ray", SimpleNamespace(get=lambda x: x))
    log: list = []
    qc = quant_config(dirs[fmt])
    updater = object.__new__(mod.UpdateWeightFromDistributed)
    updater.args, updater.quantization_config, updater.weight_version = args, qc, 0
    updater.rollout_engines, updater._is_pp_src_rank, updater._group_name = [_Engine(log)], False, "slime-pp_0"
    seen = []
    updater._send_weights = lambda pbar: seen.append(updater.quantization_config)
    mod.UpdateWeightFromDistributed.update_weights(updater)
    names = [e[0] for e in log]
    post = [e for e in log if e[0] == "post_process_weights"]
    if expect_post_process:
        assert names == ["pause_generation", "flush_cache", "post_process_weights", "post_process_weights",
                         "continue_generation"]
        assert post == [("post_process_weights", True, False), ("post_process_weights", False, True)]
    else:
        assert not post
    assert updater.quantization_config is qc  # restored after the call
    from slime_ascend.weight_sync.engine_gate import source_config

    assert source_config(seen[0]) is qc


def _slime_fp8_converter():
    path = Path(importlib.util.find_spec("slime").submodule_search_locations[0]).parent / "tools" / "convert_hf_to_fp8.py"
    assert path.is_file(), f"{path} is not in this slime tree (slime's offline FP8 converter moved?)"
    spec = importlib.util.spec_from_file_location("convert_hf_to_fp8", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _our_fp8(weight, dirs):
    from slime_ascend.weight_sync import funnel

    args = slime_args(ascend_plugins="fp8-sync", hf_checkpoint=str(dirs["fp8-block"]))
    out = dict(funnel.quantize_params(args, "m", [("model.layers.0.mlp.down_proj.weight", weight)],
                                      quant_config(dirs["fp8-block"])))
    return out["model.layers.0.mlp.down_proj.weight"], out["model.layers.0.mlp.down_proj.weight_scale_inv"]


def test_slime_block_fp8_zero_block_cases_hold(world, installed):
    """slime's tests/test_block_fp8_zero_block.py cases, on our FP8 sync path; and bit-identity with
    slime's offline block_fp8 (tools/convert_hf_to_fp8.py)."""
    _, dirs = world
    conv = _slime_fp8_converter()
    w = torch.zeros(256, 256, dtype=torch.bfloat16)
    w[0, 0] = 1.0
    q, s = _our_fp8(w, dirs)
    assert not torch.isnan(q.float()).any() and not torch.isinf(q.float()).any() and (s > 0).all()
    q, s = _our_fp8(torch.zeros(128, 128, dtype=torch.bfloat16), dirs)
    assert (q.float() * s.float() == 0).all()
    torch.manual_seed(0)
    w = torch.randn(256, 256).to(torch.bfloat16)
    q, s = _our_fp8(w, dirs)
    assert not torch.isnan(q.float()).any()
    deq = q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert (deq - w.float()).abs().max() < 0.5
    ref_q, ref_s = conv.block_fp8(w, (128, 128))
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s.float())

"""`slime-ascend memory`: the table, --json, --slime-args, bad input (one line with a Fix:)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from slime_ascend import cli

from slime_ascend.rollout.torch_engine.model import TINY_QWEN3_KWARGS

TINY = dict(TINY_QWEN3_KWARGS, model_type="qwen3")
QWEN3_8B = dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                tie_word_embeddings=False)


@pytest.fixture
def cfg_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    return tmp_path


def test_table(cfg_dir, capsys):
    assert cli.main(["memory", "--config", str(cfg_dir), "--tp", "2", "--dp", "4", "--max-tokens-per-gpu", "8192",
                     "--recompute", "full", "--teachers", "2", "--sync-format", "int8-w8a8", "--critic"]) == 0
    out = capsys.readouterr().out
    for role in ("[actor]", "[reference] (in the actor process)", "[critic]", "[rollout]", "[teacher-1]", "[teacher-2]"):
        assert role in out
    assert "8.191e9 params" in out
    assert "peak actor:" in out and "(phase: train step)" in out
    assert "weight-sync bucket: int8-w8a8 copy" in out
    assert "object" in out and "category" in out and "owner" in out and "lifetime" in out and "GiB" in out


def test_json_and_slime_args(cfg_dir, capsys):
    line = (f"python train.py --hf-checkpoint {cfg_dir} --tensor-model-parallel-size 2 --actor-num-nodes 1 "
            "--actor-num-gpus-per-node 8 --max-tokens-per-gpu 4096 --recompute-granularity selective "
            "--rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.7")
    assert cli.main(["memory", "--slime-args", line, "--json", "--kv-cache-tokens", "5000"]) == 0
    doc = json.loads(capsys.readouterr().out)
    lay = doc["layout"]
    assert (lay["tp"], lay["dp"], lay["max_tokens_per_gpu"], lay["recompute"], lay["rollout_tp"]) == \
        (2, 4, 4096, "selective", 2)
    assert lay["mem_fraction"] == 0.7 and lay["kv_cache_tokens"] == 5000
    assert doc["model"]["params"] == 8_190_735_360
    actor = doc["roles"]["actor"]
    assert actor["peak_bytes"] > 0 and actor["peak_phase"] == "train step"
    assert {e["category"] for e in actor["entries"]} >= {"model state", "saved activations", "allocator margin"}
    assert doc["roles"]["reference"]["process"] == "actor"


@pytest.mark.parametrize("critic_flags", ["--use-critic", "--advantage-estimator ppo"])
def test_slime_args_critic_is_kept(cfg_dir, capsys, critic_flags):
    """--critic not given on our command line leaves the critic that slime's line asks for."""
    line = f"python train.py --hf-checkpoint {cfg_dir} {critic_flags}"
    assert cli.main(["memory", "--slime-args", line, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["layout"]["critic"] is True and "critic" in doc["roles"]


@pytest.mark.parametrize("extra, needle", [
    (["--tp", "3"], "--tp 3 does not divide"),
    (["--recompute", "most"], "--recompute 'most' is not known"),
    (["--sync-format", "int3"], "--sync-format 'int3' is not known"),
    (["--tp", "x"], "argument --tp: invalid int value"),
    (["--slime-args", "--tensor-model-parallel-size two"], "--slime-args: --tensor-model-parallel-size 'two'"),
    (["--ep", "2"], "--ep 2"),
])
def test_bad_input_is_one_line_with_a_fix(cfg_dir, capsys, extra, needle):
    with pytest.raises(SystemExit) if extra[:2] == ["--tp", "x"] else _nothing():
        rc = cli.main(["memory", "--config", str(cfg_dir), *extra])
        assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Fix:" in err, err


def test_missing_config(tmp_path, capsys):
    assert cli.main(["memory", "--config", str(tmp_path / "nope")]) == 2
    assert "Fix:" in capsys.readouterr().err
    assert cli.main(["memory"]) == 2
    assert "--config" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    assert cli.main(["memory", "--config", str(tmp_path)]) == 2
    assert "is not valid JSON" in capsys.readouterr().err


def test_the_command_imports_no_torch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    code = ("import sys\nfrom slime_ascend import cli\nrc = cli.main(['memory', '--config', %r, '--json'])\n"
            "print([m for m in ('torch', 'transformers') if m in sys.modules], rc, file=sys.stderr)\n" % str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stderr.strip().splitlines()[-1] == "[] 0", proc.stderr


@pytest.mark.parametrize("cfg, extra, needle", [
    (TINY, ["--tp", "2"], "--measure runs one CPU train actor (--tp 2)"),
    (TINY, ["--recompute", "full"], "no recompute"),
    (TINY, ["--max-tokens-per-gpu", "30"], "is too small or not a multiple of 4"),
    (dict(TINY, model_type="qwen3_moe", num_experts=8, moe_intermediate_size=32, num_experts_per_tok=2),
     [], "dense Qwen3 models only"),
    (QWEN3_8B, ["--max-tokens-per-gpu", "2048"], "too large for this host"),
])
def test_measure_refuses_with_one_line(tmp_path, capsys, cfg, extra, needle):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert cli.main(["memory", "--config", str(tmp_path), "--measure", *extra]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and needle in err and "Fix:" in err, err


def test_measure_without_slime_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    monkeypatch.setenv("SLIME_SRC", str(tmp_path))  # not a slime tree
    assert cli.main(["memory", "--config", str(tmp_path), "--measure", "--max-tokens-per-gpu", "2048"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "--measure needs slime" in err and "Fix:" in err, err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_slime_args_mtp_training_and_a_nextn_draft(tmp_path, capsys):
    """slime's --enable-mtp-training and SGLang's NEXTN speculation (the model's own MTP layers draft) put the MTP rows
    in; STANDALONE (a separate draft model) does not."""
    cfg = dict(model_type="deepseek_v3", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, vocab_size=512,
               n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
               q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
               num_nextn_predict_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    line = (f"python train.py --hf-checkpoint {tmp_path} --enable-mtp-training --sglang-speculative-algorithm NEXTN "
            "--sglang-speculative-num-steps 3")
    assert cli.main(["memory", "--slime-args", line, "--json", "--kv-cache-tokens", "100"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["layout"]["mtp_training"] is True and doc["layout"]["rollout_mtp"] is True
    names = [e["name"] for role in doc["roles"].values() for e in role["entries"]]
    assert any(n.startswith("MTP layers' activations") for n in names)
    assert any(n.startswith("MTP draft weights") for n in names)
    assert cli.main(["memory", "--slime-args", line.replace("NEXTN", "STANDALONE"), "--json",
                     "--kv-cache-tokens", "100"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["rollout_mtp"] is False

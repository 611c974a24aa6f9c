"""``slime-ascend memory --config`` on what an operator might point it at: special files are refused before they
are read (a FIFO blocked the command, ``/dev/zero`` read until memory ran out), a config too big to be one or
nested too deeply is refused, a model too large to model (``num_hidden_layers: 1e9`` or ``num_experts: 1e7``
ran unbounded) is refused in one line naming both fields, and an impossible ``num_key_value_heads`` is
refused. Each case is the real CLI in a subprocess with a time limit, so a hang fails the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=1024)


def _memory(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slime_ascend.cli", "memory", *args], capture_output=True,
                          text=True, timeout=60)


def _one_line_refusal(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Fix:" in lines[0], proc.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def _write(tmp_path, cfg) -> str:
    p = tmp_path / "config.json"
    p.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(p)


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    _one_line_refusal(_memory("--config", str(fifo)), "FIFO")
    _one_line_refusal(_memory("--config", str(tmp_path)), "FIFO")  # the checkpoint directory holding it


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero on this host")
def test_device_is_refused_before_reading():
    _one_line_refusal(_memory("--config", "/dev/zero"), "/dev/zero", "not a regular file")


def test_oversized_and_deeply_nested_configs_are_refused(tmp_path):
    big = tmp_path / "big"
    big.mkdir()
    with open(big / "config.json", "w") as f:
        f.write('{"pad": "' + "x" * (17 * 1024 * 1024) + '"}')
    _one_line_refusal(_memory("--config", str(big)), "bytes")
    _one_line_refusal(_memory("--config", _write(tmp_path, "[" * 100_000 + "]" * 100_000)), "nested too deeply")


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 10**9), ("num_experts", 10**7)])
def test_model_too_large_to_model_is_refused_at_once(tmp_path, field, value):
    cfg = dict(TINY, **{field: value})
    if field == "num_experts":
        cfg.update(model_type="qwen3_moe", moe_intermediate_size=16, num_experts_per_tok=2)
    proc = _memory("--config", _write(tmp_path, cfg))
    _one_line_refusal(proc, "num_hidden_layers", "num_experts", "weight tensors")


@pytest.mark.parametrize("kv_heads", [3, 8])
def test_impossible_num_key_value_heads_is_refused(tmp_path, kv_heads):
    line = _one_line_refusal(_memory("--config", _write(tmp_path, dict(TINY, num_key_value_heads=kv_heads))),
                             "num_key_value_heads")
    assert f"({kv_heads})" in line


def test_a_real_shape_still_runs(tmp_path):
    proc = _memory("--config", _write(tmp_path, TINY))
    assert proc.returncode == 0 and "actor" in proc.stdout, proc.stderr

"""The train-step probe slime calls inside its train actor: RSS, its reset peak, the model state it counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slime_ascend.memory import probe

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")

MIB = 1024**2

# a fresh process (its own peak to reset), malloc pinned to mmap as the measurement job runs it
_CHILD = r"""
import json, os
import torch
from slime_ascend.memory import probe
rss0, _ = probe.read_status()
buf = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, written
del buf
rss1, hwm1 = probe.read_status()
probe.reset_peak()
rss2, hwm2 = probe.read_status()
print(json.dumps(dict(rss0=rss0, rss1=rss1, hwm1=hwm1, rss2=rss2, hwm2=hwm2)))
"""


def test_peak_sees_a_freed_buffer_and_resets():
    root = str(Path(probe.__file__).resolve().parents[2])
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "PATH": "/usr/bin:/bin", "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["rss1"] - r["rss0"] < 8 * MIB          # the buffer went back to the OS
    assert r["hwm1"] - r["rss0"] >= 63 * MIB          # but the peak saw it
    assert r["hwm2"] - r["rss2"] < 8 * MIB            # the reset brings the peak back to the resident set


def test_model_state_counts_each_storage_once():
    import torch

    model = torch.nn.Linear(10, 20)                   # 220 fp32 parameters: 880 B
    model.weight.main_grad = torch.zeros(20, 10)      # Megatron's fp32 grad buffer for the weight: 800 B
    opt = torch.optim.Adam(model.parameters())
    assert probe.model_state_bytes([model], opt) == {"params": 880, "grads": 800, "optimizer": 0}
    model(torch.ones(3, 10)).sum().backward()
    opt.step()
    # exp_avg + exp_avg_sq per parameter (2 x 880 B) and a 4-byte fp32 step counter per parameter
    assert probe.model_state_bytes([model], opt) == {"params": 880, "grads": 800, "optimizer": 2 * 880 + 2 * 4}


def test_hook_writes_one_line_per_step_and_nothing_without_its_env(tmp_path, monkeypatch):
    import torch

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.delenv(probe.ENV, raising=False)
    probe.before_train_step(None, 0, 0, [model], opt, None)
    path = tmp_path / "probe.jsonl"
    monkeypatch.setenv(probe.ENV, str(path))
    for step in (0, 1):
        probe.before_train_step(None, 3, step, [model], opt, None)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["rollout"], r["step"]) for r in rows] == [(3, 0), (3, 1)]
    assert all(r["hwm"] >= r["rss"] > 0 and r["model_state"]["params"] == 80 for r in rows)

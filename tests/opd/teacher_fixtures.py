"""Tiny real safetensors teachers (and a student) on CPU for the teacher-pool tests."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from slime_ascend.opd.safetensors_dir import read_safetensors_dir

VOCAB = 16


def tiny_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Tanh(), torch.nn.Linear(12, VOCAB))


def write_teacher(root, name, seed, vocab=VOCAB):
    torch.manual_seed(seed)
    d = root / name
    d.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tiny_model().state_dict().items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    (d / "tokenizer.json").write_text("shared-tokenizer")
    return d


@pytest.fixture
def teachers(tmp_path):
    dirs = {n: write_teacher(tmp_path, n, i) for i, n in enumerate(["math", "code", "chat"])}
    student = write_teacher(tmp_path, "student", 99)
    specs = [{"name": n, "checkpoint_dir": str(d), "domains": [n]} for n, d in dirs.items()]
    return specs, dirs, student


def weights_of(d):
    state, _ = read_safetensors_dir(d)
    return state

"""A teacher checkpoint an operator (or a neighbour who can write into it) got wrong: a ``*.safetensors`` that
is a FIFO froze the process that validated or prefetched the teacher, and a deeply nested ``config.json``
escaped the compatibility check as a RecursionError. Both are now a ``ValueError`` naming the file, at once.
Each case runs under a time limit in a child thread so a hang fails instead of freezing the suite."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from safetensors.torch import save_file

from slime_ascend.opd import compat
from slime_ascend.opd.safetensors_dir import read_safetensors_dir, safetensors_files, validate_safetensors_dir


def _within(seconds: float, fn, *args):
    """``fn(*args)``'s exception (or None) if it returns within ``seconds``; the test fails on a hang."""
    box: dict[str, BaseException | None] = {}

    def run():
        try:
            fn(*args)
            box["exc"] = None
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert "exc" in box, f"{fn.__name__} did not return within {seconds} s (blocked on a FIFO?)"
    return box["exc"]


@pytest.fixture
def teacher_with_fifo(tmp_path):
    save_file({"w": torch.ones(2, 2)}, str(tmp_path / "model-00001.safetensors"))
    os.mkfifo(tmp_path / "model-00002.safetensors")
    return tmp_path


@pytest.mark.parametrize("reader", [safetensors_files, validate_safetensors_dir, read_safetensors_dir])
def test_a_fifo_shard_is_refused_without_blocking(teacher_with_fifo, reader):
    exc = _within(10, reader, teacher_with_fifo)
    assert isinstance(exc, ValueError) and "FIFO" in str(exc) and "model-00002.safetensors" in str(exc), exc


def test_regular_shards_still_read(tmp_path):
    save_file({"w": torch.arange(4.0)}, str(tmp_path / "model.safetensors"))
    state, total = read_safetensors_dir(tmp_path)
    assert torch.equal(state["w"], torch.arange(4.0)) and total == 16


def test_a_deeply_nested_teacher_config_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    exc = _within(10, compat.read_config_vocab_size, tmp_path)
    assert isinstance(exc, ValueError) and "nested too deeply" in str(exc) and "config.json" in str(exc), exc
    compat.clear_cache()
    fp = compat.fingerprint_dir(tmp_path)  # the compatibility check reports it instead of crashing
    assert "nested too deeply" in fp.unknown["vocab_size"], fp.unknown


def test_a_fifo_teacher_config_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "config.json")
    exc = _within(10, compat.read_config_vocab_size, tmp_path)
    assert isinstance(exc, ValueError) and "FIFO" in str(exc), exc


def test_an_ordinary_config_still_gives_its_vocab(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 1024}}))
    assert compat.read_config_vocab_size(tmp_path) == 1024

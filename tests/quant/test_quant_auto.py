"""`auto` (the default kernel choice) keeps the native kernels only where they are not slower than
eager on this machine: timed once on a calibration weight, cached in the process and beside the
kernel library; whichever path runs, the bits are the eager path's."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch

from slime_ascend.quant import fused as F
from slime_ascend.quant import native as N
from slime_ascend.quant.fp8_block import quantize_fp8_block
from slime_ascend.quant.int_quant import quantize_int
from slime_ascend.quant.schemes import INT8_ASCEND_SCHEME, FP8BlockScheme

HAVE_CC = shutil.which("cc") is not None or shutil.which("gcc") is not None
pytestmark = pytest.mark.skipif(not N.available() and not HAVE_CC,
                                reason=f"no C compiler: native kernels unavailable ({N.unavailable_reason()})")
FP8_KEY = ("fp8", "native", FP8BlockScheme(), torch.bfloat16, "cpu")
INT_KEY = ("int", "native", INT8_ASCEND_SCHEME, torch.bfloat16, "cpu")


@pytest.fixture
def private_choices(tmp_path, monkeypatch):
    """auto's stored choices go to a temporary file (never the real cache), verdicts start afresh."""
    assert N.available(), N.unavailable_reason()
    path = tmp_path / "choices.json"
    monkeypatch.setattr(N, "_choices_path", lambda: path)
    F.reset()
    yield path
    F.reset()


def _calls(monkeypatch):
    """Count the native FP8 / INT kernel calls."""
    n = {"fp8": 0, "int": 0}
    fp8, intq = N.fp8_block_quantize, N.int_quantize

    def counted_fp8(*a, **k):
        n["fp8"] += 1
        return fp8(*a, **k)

    def counted_int(*a, **k):
        n["int"] += 1
        return intq(*a, **k)

    monkeypatch.setattr(N, "fp8_block_quantize", counted_fp8)
    monkeypatch.setattr(N, "int_quantize", counted_int)
    return n


def _same_fp8(a, b):
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def test_auto_keeps_native_where_it_is_faster(private_choices, monkeypatch):
    monkeypatch.setattr(F, "_best_times", lambda fast, eager, repeats: (1.0, 2.0))
    w = torch.randn(300, 700, dtype=torch.bfloat16)
    calls = _calls(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto's timing is silent
        got = quantize_fp8_block(w)
    assert F.auto_choice(FP8_KEY) is True and calls["fp8"] > 0
    assert _same_fp8(got, quantize_fp8_block(w, fused=False))


def test_auto_runs_eager_where_native_is_slower_with_the_same_bits(private_choices, monkeypatch):
    monkeypatch.setattr(F, "_best_times", lambda fast, eager, repeats: (2.0, 1.0))
    w = torch.randn(300, 700, dtype=torch.bfloat16)
    fp8, q = quantize_fp8_block(w), quantize_int(w, INT8_ASCEND_SCHEME)  # self-checks and timings here
    assert F.auto_choice(FP8_KEY) is False and F.auto_choice(INT_KEY) is False
    assert F.verdict(FP8_KEY) is True  # the kernel is correct, only slower
    calls = _calls(monkeypatch)
    fp8_again, q_again = quantize_fp8_block(w), quantize_int(w, INT8_ASCEND_SCHEME)
    assert calls == {"fp8": 0, "int": 0}  # auto ran eager
    ref = quantize_fp8_block(w, fused=False), quantize_int(w, INT8_ASCEND_SCHEME, fused=False)
    assert _same_fp8(fp8, ref[0]) and _same_fp8(fp8_again, ref[0])
    assert torch.equal(q.q, ref[1].q) and torch.equal(q_again.scale, ref[1].scale)
    quantize_fp8_block(w, fused="native")  # asking for native explicitly still runs it
    assert calls["fp8"] == 1


def test_the_choice_is_stored_beside_the_kernel_and_reused(private_choices, monkeypatch):
    timed = []
    monkeypatch.setattr(F, "_best_times", lambda fast, eager, repeats: timed.append(1) or (1.0, 3.0))
    w = torch.randn(256, 512, dtype=torch.bfloat16)
    quantize_fp8_block(w)
    assert timed == [1]
    stored = json.loads(private_choices.read_text())
    (key, entry), = stored.items()
    assert entry["native"] is True and entry["fast_ms"] == 1000.0 and entry["eager_ms"] == 3000.0
    assert key == repr((*FP8_KEY, torch.get_num_threads()))
    assert not private_choices.stat().st_mode & 0o022
    F.reset()  # a new process: no in-memory choice, the stored one is read
    quantize_fp8_block(w)
    assert timed == [1] and F.auto_choice(FP8_KEY) is True


def test_the_thread_count_is_part_of_the_choice(private_choices, monkeypatch):
    monkeypatch.setattr(F, "_best_times", lambda fast, eager, repeats: (1.0, 2.0))
    w = torch.randn(256, 512, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    quantize_fp8_block(w)
    try:
        torch.set_num_threads(1 if threads != 1 else 2)
        assert F.auto_choice(FP8_KEY) is None
        monkeypatch.setattr(F, "_best_times", lambda fast, eager, repeats: (2.0, 1.0))
        quantize_fp8_block(w)
        assert F.auto_choice(FP8_KEY) is False
    finally:
        torch.set_num_threads(threads)
    assert F.auto_choice(FP8_KEY) is True and len(json.loads(private_choices.read_text())) == 2


def test_a_record_others_can_write_is_ignored(private_choices, monkeypatch):
    key = repr((*FP8_KEY, torch.get_num_threads()))
    private_choices.write_text(json.dumps({key: {"native": False}}))
    os.chmod(private_choices, 0o666)
    assert N.stored_choice(key) is None
    os.chmod(private_choices, 0o600)
    assert N.stored_choice(key) is False
    private_choices.write_text("{not json")
    assert N.stored_choice(key) is None


def test_a_failure_while_timing_means_eager_in_this_process(private_choices, monkeypatch):
    def boom(fast, eager, repeats):
        raise RuntimeError("timer broke")

    monkeypatch.setattr(F, "_best_times", boom)
    w = torch.randn(256, 512, dtype=torch.bfloat16)
    assert _same_fp8(quantize_fp8_block(w), quantize_fp8_block(w, fused=False))
    assert F.auto_choice(FP8_KEY) is False and not private_choices.exists()


def test_real_timing_on_the_calibration_weight(private_choices):
    """Unpatched: the calibration runs both paths (a few ms each) and records what it measured."""
    w = torch.randn(256, 512, dtype=torch.bfloat16)
    quantize_int(w, INT8_ASCEND_SCHEME)
    entry = json.loads(private_choices.read_text())[repr((*INT_KEY, torch.get_num_threads()))]
    assert entry["fast_ms"] > 0 and entry["eager_ms"] > 0 and entry["native"] == (entry["fast_ms"] <= entry["eager_ms"])
    assert entry["shape"] == list(F.CALIBRATION_SHAPE)

"""benchmarks/bench_speculative_rollout.py at a tiny size: both pairs print their rows; with the agreeing draft every
draft token is kept (accept length above 4 of the 5 a step can emit), the tokens equal plain decoding and the log-prob
gap is within 1e-6 (no timing asserts: the speed ratio is printed, not checked)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "benchmarks" / "bench_speculative_rollout.py"


def test_bench_prints_both_pairs():
    r = subprocess.run([sys.executable, str(BENCH), "--quick", "--new", "16", "--extra-layers", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    agree = re.search(r"agreeing draft: .* ratio ([\d.]+); accept length ([\d.]+) .*; tokens identical; log-prob gap "
                      r"([\d.e+-]+);", out)
    assert agree, out
    assert float(agree.group(2)) > 4 and float(agree.group(3)) <= 1e-6, out
    near = re.search(r"near draft .*accept length ([\d.]+) .*; tokens identical; log-prob gap ([\d.e+-]+);", out)
    assert near and float(near.group(2)) <= 1e-6, out
    assert len(re.findall(r"^RESULT speculative_rollout/(agree|near) ratio=[\d.]+ ", out, re.M)) == 2, out

"""benchmarks/bench_weight_sync.py runs end to end at a tiny size and prints its table (no timing asserts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "benchmarks" / "bench_weight_sync.py"


def test_bench_weight_sync_runs_and_prints_ratios(tmp_path):
    r = subprocess.run([sys.executable, str(BENCH), "--size", "0.5", "--hidden", "128", "--bucket-mb", "0.25",
                        "--repeat", "1", "--dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert out.startswith("host: ") and "memcpy of the model's bytes" in out
    rows = [line.split() for line in out.splitlines()
            if line.split()[:1] and line.split()[0] in ("disk", "distributed", "tensor")]
    assert [(row[0], row[1]) for row in rows] == [(t, f) for t in ("disk", "distributed", "tensor")
                                                 for f in ("bf16", "int8", "fp8-block", "mxfp8")
                                                 + (("mxfp8-delta",) if t == "distributed" else ())]
    assert "delta push (mxfp8, 0.01 of the values moved by 1%): density " in out
    for row in rows:
        wire_mib, seconds, s_per_gb, ratio = map(float, row[2:6])
        assert seconds > 0 and s_per_gb > 0 and ratio > 0
    assert float(rows[3][2]) < float(rows[0][2]) and float(rows[8][2]) <= float(rows[7][2])  # mxfp8 on the wire: 1 + 1/32 bytes per bf16 value's 2
    assert "goal distributed bf16 <= 2x memcpy" in out and out.count("goal quantised <= bf16 on") == 3
    assert os.listdir(tmp_path) == []  # the disk pushes leave nothing behind

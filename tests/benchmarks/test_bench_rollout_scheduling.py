"""benchmarks/bench_rollout_scheduling.py runs end to end on two real torch engines at a tiny size (no timing asserts:
every request got exactly its length, both ways produced their rows)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "benchmarks" / "bench_rollout_scheduling.py"


@pytest.mark.slow
def test_bench_rollout_scheduling_runs_and_prints_both_ways():
    r = subprocess.run([sys.executable, str(BENCH), "--engines", "2", "--requests", "6", "--seeds", "1"],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.startswith("rollout_scheduling/")}
    assert set(rows) == {"rollout_scheduling/default", "rollout_scheduling/cosched",
                         "rollout_scheduling/default_over_cosched"}, r.stdout
    assert all(float(row[1]) > 0 for row in rows.values())
    assert r.stdout.startswith("host: ")


def test_bench_refuses_a_bad_layout_in_one_line():
    r = subprocess.run([sys.executable, str(BENCH), "--engines", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--engines must be 1..8" in r.stderr and "Traceback" not in r.stderr

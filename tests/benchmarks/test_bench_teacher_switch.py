"""benchmarks/bench_teacher_switch.py: the switch-order comparison runs at a tiny size and prints both orders side
by side (no timing asserts)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "benchmarks" / "bench_teacher_switch.py"


def test_bench_prints_switches_per_rollout_for_both_orders():
    r = subprocess.run([sys.executable, str(BENCH), "--order-only", "--rollouts", "4", "--samples", "12"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    needed = [int(x) for x in re.search(r"teachers needed \[([\d, ]+)\]", out).group(1).split(", ")]
    rows = {}
    for order in ("completion order", "grouped"):
        m = re.search(rf"^  {order} +\[([\d, ]+)\]  total (\d+)  wall ([\d.]+) s/rollout$", out, re.M)
        assert m, out
        rows[order] = [int(x) for x in m.group(1).split(", ")]
        assert sum(rows[order]) == int(m.group(2)) and float(m.group(3)) > 0
    assert len(needed) == len(rows["grouped"]) == len(rows["completion order"]) == 4
    assert all(g <= n for g, n in zip(rows["grouped"], needed, strict=True)), out
    assert sum(rows["grouped"]) <= sum(rows["completion order"])
    assert re.search(r"^RESULT teacher_switch_order ratio=[\d.]+ target=<=needed PASS$", out, re.M), out


@pytest.mark.slow
def test_bench_engine_rows_switch_a_torch_engine_four_ways_and_print_the_ratios():
    r = subprocess.run([sys.executable, str(BENCH), "--order-only", "--engine", "--quick"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    disks = set()
    for row, how, versions in (("teacher_switch_engine", "weight-update group", "'opd:teacher0:1', 'opd:teacher2:2'"),
                               ("teacher_switch_engine_tensor", "shared memory (/update_weights_from_tensor, donated",
                                "'opd:teacher1:1', 'opd:teacher0:2'"),
                               ("teacher_switch_engine_tensor_copied", "shared memory and copied",
                                "'opd:teacher0:1', 'opd:teacher1:2'")):
        m = re.search(r"disk reload \(page cache dropped\) \[([\d., ]+)\] s.*staged push \(prefetched while scoring, "
                      rf"[^)]*{re.escape(how)}[^)]*\)+ \[([\d., ]+)\] s.*versions \[([^\]]*)\]", out)
        assert m, out
        disks.add(m.group(1))
        assert len(m.group(1).split(",")) == len(m.group(2).split(",")) == 2  # two switches each way, interleaved
        assert m.group(3) == versions, out  # the engine served each pushed teacher
        assert re.search(rf"^RESULT {row} ratio=[\d.]+ target=<=0.1 (PASS|FAIL)$", out, re.M), out
    assert len(disks) == 1  # every row over the same disk reloads

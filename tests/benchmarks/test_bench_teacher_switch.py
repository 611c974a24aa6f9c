"""benchmarks/bench_teacher_switch.py: the switch-order comparison runs at a tiny size and prints both orders side
by side (no timing asserts)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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

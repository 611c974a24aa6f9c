"""benchmarks/bench_mtp_rollout.py at its quick size: the MTP layer is distilled (its loss falls), NEXTN decodes the
plain engine's tokens with the served model's log-probs (gap within 1e-6), the distilled layer's drafts are kept
more often than the untrained one's, and the RESULT row prints (no timing asserts: the ratio is printed, not
checked)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "benchmarks" / "bench_mtp_rollout.py"


def test_bench_distills_and_prints_its_row():
    r = subprocess.run([sys.executable, str(BENCH), "--quick", "--layers", "4"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    row = re.search(r"loss ([\d.]+) -> ([\d.]+) nats.*accept length ([\d.]+) tokens a verifying forward \(untrained "
                    r"layer: ([\d.]+)\); tokens identical; log-prob gap ([\d.e+-]+)", out)
    assert row, out
    before, after, accept, untrained, gap = (float(x) for x in row.groups())
    assert after < before and accept > untrained and gap <= 1e-6, out
    assert re.search(r"^RESULT mtp_rollout/nextn ratio=[\d.]+ ", out, re.M), out

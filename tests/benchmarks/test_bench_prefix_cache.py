"""benchmarks/bench_prefix_cache.py at its --quick size: the three ways give the same greedy tokens (the benchmark
raises otherwise) and the prompt tokens reused are the ones the cache's rule gives (no timing asserted)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "benchmarks" / "bench_prefix_cache.py"


def test_bench_prefix_cache_quick_rows():
    spec = importlib.util.spec_from_file_location("_bench_prefix_cache_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    rows = {row["name"]: row for row in module.run(quick=True)}
    assert set(rows) == {"prefix_cache/owner_saved_fraction", "prefix_cache/off_over_owner_seconds",
                         "prefix_cache/moved_saved_fraction"}
    assert all(row["passed"] is None for row in rows.values())  # --quick: rows only
    # 4 sessions x 3 turns of 128 + 80 t prompt tokens (2496 in all); owner: turn t reuses turn t-1's prompt and
    # 15 of its 16 outputs (143 + 223 a session); moved: only turn 2, on turn 0's engine (143 a session)
    assert rows["prefix_cache/owner_saved_fraction"]["detail"].startswith("1464 of 2496 prompt tokens reused")
    assert rows["prefix_cache/moved_saved_fraction"]["detail"].startswith("572 of 2496 prompt tokens reused")
    assert rows["prefix_cache/off_over_owner_seconds"]["ratio"] > 0

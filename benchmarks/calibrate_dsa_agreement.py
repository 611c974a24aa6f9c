"""Calibration of ``slime-ascend check``'s DSA bounds: the bf16-vs-fp32 index-set agreement of the indexer's
deterministic top-k (``dsa_topk.bf16_vs_fp32.rows_identical_frac`` / ``.jaccard_mean``), measured over many
seeds, and what a perturbed score does to it.

Prints, for the check's shape (``DSA_SHAPE``) over ``--seeds`` seeds and for a few other shapes over fewer,
the distribution (min, 0.5%/5% quantiles, median, max, mean, sd) of both statistics, then the same for the
bf16 scores with N(0, (r * std)^2) noise for a few r (the ``dsa_bf16_noise`` fault is one of them), and the
bounds this rule gives: ``min over the seeds - 3 sd``, rounded down to 0.01 (rows) / 0.001 (Jaccard). Not a
speed benchmark (``run_all`` runs ``bench_*.py`` only). Run: ``python benchmarks/calibrate_dsa_agreement.py
[--seeds 200] [--device cpu]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

from slime_ascend.contracts.check import _DSA_FAULT_NOISE, DSA_SHAPE, DSA_TOPK_THRESHOLDS, dsa_bf16_agreement

STATS = ("rows_identical_frac", "jaccard_mean")
OTHER_SHAPES = ((1024, 8, 32, 64), (512, 16, 64, 64), (512, 8, 32, 128), (2048, 8, 32, 256))
NOISE = (0.0025, _DSA_FAULT_NOISE, 0.01)


def quantile(values: list[float], p: float) -> float:
    """Lower empirical quantile (the sorted value at floor(p * (n - 1)))."""
    ordered = sorted(values)
    return ordered[int(p * (len(ordered) - 1))]


def summary(values: list[float]) -> str:
    return (f"min {min(values):.4f}  q0.5% {quantile(values, 0.005):.4f}  q5% {quantile(values, 0.05):.4f}  "
            f"median {statistics.median(values):.4f}  max {max(values):.4f}  mean {statistics.mean(values):.4f}  "
            f"sd {statistics.pstdev(values):.5f}")


def measure(shape, seeds: int, device: str, noise: float = 0.0) -> dict[str, list[float]]:
    runs = [dsa_bf16_agreement(seed, shape, device, noise) for seed in range(seeds)]
    return {stat: [r[stat] for r in runs] for stat in STATS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=200, help="seeds at the check's shape (default 200)")
    p.add_argument("--other-seeds", type=int, default=20, help="seeds at each other shape (default 20)")
    p.add_argument("--device", default="cpu")
    ns = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _host import describe

    print(f"host: {describe()}; device {ns.device}")
    t0 = time.perf_counter()
    clean = measure(DSA_SHAPE, ns.seeds, ns.device)
    print(f"shape {DSA_SHAPE} (the check's), seeds 0-{ns.seeds - 1}, clean:")
    for stat in STATS:
        print(f"  {stat:20s} {summary(clean[stat])}")
    steps = {"rows_identical_frac": 0.01, "jaccard_mean": 0.001}
    proposed = {}
    for stat in STATS:
        raw = min(clean[stat]) - 3 * statistics.pstdev(clean[stat])
        proposed[stat] = math.floor(raw / steps[stat]) * steps[stat]
    print(f"  bounds (min - 3 sd, rounded down): {proposed}; in use: {DSA_TOPK_THRESHOLDS}")
    for noise in NOISE:
        faulty = measure(DSA_SHAPE, min(ns.seeds, 50), ns.device, noise)
        print(f"shape {DSA_SHAPE}, bf16 scores + N(0, ({noise} std)^2), seeds 0-{min(ns.seeds, 50) - 1}:")
        for stat in STATS:
            caught = sum(v < DSA_TOPK_THRESHOLDS[stat] for v in faulty[stat]) / len(faulty[stat])
            print(f"  {stat:20s} {summary(faulty[stat])}  below the bound in use: {caught:.0%}")
    for shape in OTHER_SHAPES:
        other = measure(shape, ns.other_seeds, ns.device)
        print(f"shape {shape}, seeds 0-{ns.other_seeds - 1}, clean:")
        for stat in STATS:
            print(f"  {stat:20s} {summary(other[stat])}")
    print(f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

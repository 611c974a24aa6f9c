"""Benchmark: deterministic top-k (ours) vs torch.topk on CPU.

Full size: 8 rows x L=131072 float32, k=2048 (DSA index_topk). Target: ours/torch <= 2.0.
Interleaved repeats, median time of each. Run: ``python benchmarks/bench_topk.py [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from slime_ascend.algorithms.topk import deterministic_topk_indices

TARGET = 2.0


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _case(name: str, scores: torch.Tensor, k: int, repeats: int) -> dict:
    ours = lambda: deterministic_topk_indices(scores, k)  # noqa: E731
    base = lambda: torch.topk(scores, k, dim=-1)  # noqa: E731
    for _ in range(2):  # warm-up
        ours(), base()
    t_ours, t_base = [], []
    for _ in range(repeats):
        t_base.append(_time(base))
        t_ours.append(_time(ours))
    mo, mb = statistics.median(t_ours), statistics.median(t_base)
    ratio = mo / mb
    return {
        "name": name,
        "ratio": ratio,
        "target": f"<={TARGET}",
        "passed": ratio <= TARGET,
        "detail": f"shape={tuple(scores.shape)} k={k} ours={mo * 1e3:.2f}ms torch.topk={mb * 1e3:.2f}ms "
        f"threads={torch.get_num_threads()}",
    }


def run(quick: bool = False) -> list[dict]:
    length, k, rows, repeats = (16384, 256, 8, 15) if quick else (131072, 2048, 8, 21)
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(rows, length, generator=g, dtype=torch.float32)
    # Realistic tie case: bf16-rounded scores (many ties at the threshold), causal -inf tail on half the rows.
    tied = rand.to(torch.bfloat16).float()
    tied[: rows // 2, length // 2 :] = float("-inf")
    return [
        _case("topk_random_fp32", rand, k, repeats),
        _case("topk_bf16_ties_neginf", tied, k, repeats),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller size")
    args = ap.parse_args()
    for row in run(quick=args.quick):
        print(row["detail"])
        verdict = "PASS" if row["passed"] else "FAIL"
        print(f"RESULT {row['name']} ratio={row['ratio']:.2f} target={row['target']} {verdict}")


if __name__ == "__main__":
    main()

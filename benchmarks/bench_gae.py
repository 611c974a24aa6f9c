"""Skip-observation GAE vs slime's chunked_gae on one 131072-token trajectory, half observation spans (CPU).

Ours runs the full skip-observation pipeline (compact action tokens, scan, scatter back). The baseline is
slime's ``chunked_gae`` over all tokens when ``/opt/slime-src`` (or an installed slime) is importable,
otherwise our own ``token_gae`` over all tokens (reported as the baseline name). Target: ours/baseline <= 1.5.

The ratio is measured with one intra-op thread on both sides (``--threads``, default 1): on an oversubscribed
CPU (other jobs sharing the cores) multi-threaded OpenMP ops stall at barriers and the ratio swings by several x
between runs; one thread gives a stable, like-for-like number. The ratio with torch's default thread count is
measured too and reported in ``detail``.

Run: ``python benchmarks/bench_gae.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from slime_ascend.algorithms.gae import length_adaptive_lambda, skip_observation_gae, token_gae  # noqa: E402

TARGET = 1.5


def _baseline():
    for path in (None, "/opt/slime-src"):
        if path is not None and path not in sys.path:
            sys.path.append(path)
        try:
            from slime.utils.ppo_utils import chunked_gae  # type: ignore[import-not-found]

            def run_slime(v: torch.Tensor, r: torch.Tensor, gamma: float, lam: float):
                return chunked_gae(r[None], v[None], gamma, lam)

            return "slime.chunked_gae", run_slime
        except Exception:  # noqa: BLE001 - any import failure means "no slime"
            continue

    def run_ours(v: torch.Tensor, r: torch.Tensor, gamma: float, lam: float):
        return token_gae([v], [r], gamma, lam)

    return "slime_ascend.token_gae (slime not importable)", run_ours


def _trajectory(T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Alternating action/observation spans of random length (50..500), about half observation tokens."""
    g = torch.Generator().manual_seed(seed)
    spans = torch.randint(50, 501, (T // 50 + 2,), generator=g)
    kinds = torch.arange(spans.numel()) % 2 == 0  # action, observation, action, ...
    mask = torch.repeat_interleave(kinds, spans)[:T]
    values = torch.randn(T, generator=g)
    rewards = torch.zeros(T)
    rewards[int(mask.nonzero().max())] = 1.0
    return values, rewards, mask


def _measure(ours, theirs, repeats: int) -> tuple[float, float]:
    ours(), theirs()  # warm-up
    t_ours, t_base = [], []
    for _ in range(repeats):
        for fn, acc in ((ours, t_ours), (theirs, t_base)):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return statistics.median(t_ours), statistics.median(t_base)


def run(quick: bool = False, threads: int = 1) -> list[dict]:
    T = 16384 if quick else 131072
    repeats = 5 if quick else 15
    values, rewards, mask = _trajectory(T)
    n_act = int(mask.sum())
    gamma, lam = 1.0, length_adaptive_lambda(n_act)
    base_name, base = _baseline()

    def ours():
        return skip_observation_gae([values], [rewards], [mask], gamma, lam)

    def theirs():
        return base(values, rewards, gamma, lam)

    default_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        mo, mb = _measure(ours, theirs, repeats)
    finally:
        torch.set_num_threads(default_threads)
    do, db = _measure(ours, theirs, repeats)
    ratio = mo / mb
    detail = (
        f"T={T} action_tokens={n_act} lambda={lam:.6f} baseline={base_name}; "
        f"threads={threads}: ours={mo * 1e3:.2f}ms baseline={mb * 1e3:.2f}ms; "
        f"threads={default_threads} (default): ours={do * 1e3:.2f}ms baseline={db * 1e3:.2f}ms ratio={do / db:.2f} "
        f"(medians of {repeats}, interleaved)"
    )
    return [{"name": "gae", "ratio": ratio, "target": f"<={TARGET}", "passed": ratio <= TARGET, "detail": detail}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16384 tokens, fewer repeats")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads for the primary ratio (default 1)")
    args = ap.parse_args()
    for row in run(quick=args.quick, threads=args.threads):
        print(row["detail"])
        verdict = "PASS" if row["passed"] else "FAIL"
        print(f"RESULT {row['name']} ratio={row['ratio']:.2f} target={row['target']} {verdict}")


if __name__ == "__main__":
    main()

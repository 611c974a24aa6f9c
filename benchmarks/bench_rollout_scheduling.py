"""Rollout makespan: slime's default dispatch vs the ``cosched`` dispatcher, on real torch engines (one run).

``--engines`` torch engines (default 2; each one torch thread) serve the tiny Qwen3. One batch of requests with
long-tailed response lengths (``ignore_eos``: exact lengths; most at the median, a few ``--tail-factor`` x longer)
is generated twice per seed, the two ways interleaved:

* **default**, as slime does it: at most ``--concurrency`` x engines requests in flight (slime's semaphore,
  ``--sglang-server-concurrency`` per engine), each placed round robin by the router as it is sent
  (sglang-router's ``round_robin``), whichever engine has just freed;
* **cosched**: the same bound, but each request waits in
  :class:`slime_ascend.cosched.dispatch.CapacityDispatcher` (``--concurrency`` slots per engine) and goes to an
  engine with a free slot.

Reported per way: makespan, each engine's idle fraction within the makespan, and the makespan's ratio to the ideal
(the summed busy time of the engines divided by their number: perfect balance of the same work). Target: cosched
within 10% of the ideal where the default is further from it. Seeds shuffle the batch order (where the long
requests land); medians over seeds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _host import describe  # noqa: E402

NAME = "rollout_scheduling"
TARGET = 1.10


def _lengths(n: int, median: int, tail: int, factor: int, seed: int) -> list[int]:
    lengths = [median] * (n - tail) + [median * factor] * tail
    random.Random(seed).shuffle(lengths)
    return lengths


async def _generate(client, url: str, length: int) -> None:
    payload = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": length, "ignore_eos": True,
                                                                "temperature": 1.0}}
    r = await client.post(url + "/generate", json=payload, timeout=600)
    r.raise_for_status()
    got = len(r.json()["meta_info"].get("output_token_logprobs") or []) or r.json()["meta_info"]["completion_tokens"]
    assert got == length, (got, length)


def _idle(spans: dict[str, list[tuple[float, float]]], start: float, end: float) -> dict[str, float]:
    """Per engine: the fraction of [start, end] with no request of it in flight."""
    out = {}
    for url, items in spans.items():
        busy, cur_s, cur_e = 0.0, None, None
        for s, e in sorted(items):
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            busy += cur_e - cur_s
        out[url] = 1.0 - busy / (end - start)
    return out


async def _one_way(urls: list[str], lengths: list[int], way: str, capacity: int = 2) -> dict:
    import httpx

    from slime_ascend.cosched.dispatch import CapacityDispatcher

    spans: dict[str, list[tuple[float, float]]] = {u: [] for u in urls}
    d = CapacityDispatcher(capacity)
    d.set_engines(urls)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(lengths) + 4)) as client:
        bound = asyncio.Semaphore(capacity * len(urls))
        placed = iter(range(10**9))

        async def request(i: int, length: int) -> None:
            async with bound:
                url = urls[next(placed) % len(urls)] if way == "default" else await d.acquire()
                t0 = time.perf_counter()
                try:
                    await _generate(client, url, length)
                finally:
                    spans[url].append((t0, time.perf_counter()))
                    if way == "cosched":
                        d.release(url)

        start = time.perf_counter()
        await asyncio.gather(*(request(i, n) for i, n in enumerate(lengths)))
        end = time.perf_counter()
    idle = _idle(spans, start, end)
    makespan = end - start
    busy = sum((1 - f) * makespan for f in idle.values())
    return {"makespan": makespan, "idle": [idle[u] for u in urls], "ideal": busy / len(urls)}


def run(quick: bool = False, engines: int = 2, n: int = 32, median: int = 8, tail: int = 3, factor: int = 20,
        seeds: int | None = None, concurrency: int = 2) -> list[dict]:
    from slime_ascend.demo.slime_job import make_model, start_engine, stop

    seeds = seeds if seeds is not None else (2 if quick else 6)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # each engine one thread: engines are the parallel units
    rows: dict[str, list[dict]] = {"default": [], "cosched": []}
    with tempfile.TemporaryDirectory(prefix="bench-sched-") as tmp:
        root = Path(tmp)
        model = make_model(root / "tiny-qwen3")
        procs = [start_engine(model, root / f"engine{i}.log") for i in range(engines)]
        try:
            urls = [p.url for p in procs]
            asyncio.run(_one_way(urls, [median] * engines, "default"))  # warm-up: first forward passes
            for seed in range(seeds):
                lengths = _lengths(n, median, tail, factor, seed)
                for way in ("default", "cosched") if seed % 2 == 0 else ("cosched", "default"):
                    rows[way].append(asyncio.run(_one_way(urls, lengths, way, concurrency)))
        finally:
            for p in procs:
                stop(p.proc)
    out = []
    summary = {}
    for way, results in rows.items():
        ratio = statistics.median(r["makespan"] / r["ideal"] for r in results)
        idle = statistics.median(max(r["idle"]) for r in results)
        summary[way] = (ratio, idle, statistics.median(r["makespan"] for r in results))
    d_ratio, c_ratio = summary["default"][0], summary["cosched"][0]
    for way, (ratio, idle, makespan) in summary.items():
        out.append({"name": f"{NAME}/{way}", "ratio": ratio, "target": TARGET if way == "cosched" else None,
                    "passed": (ratio <= TARGET or ratio <= d_ratio) if way == "cosched" else None,
                    "detail": f"makespan {makespan:.2f} s, most idle engine {idle:.0%} of the makespan; {engines} "
                              f"engines x {concurrency} in flight, {n} requests ({tail} x{factor} the median {median} tokens), "
                              f"median of {len(rows[way])} seeds"})
    out.append({"name": f"{NAME}/default_over_cosched", "ratio": summary["default"][2] / summary["cosched"][2],
                "target": None, "passed": None, "detail": "makespan of the default dispatch / cosched's"})
    del d_ratio, c_ratio
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight per engine (both ways)")
    p.add_argument("--seeds", type=int, default=None)
    ns = p.parse_args()
    if not 1 <= ns.engines <= 8 or ns.requests < ns.engines or ns.concurrency < 1:
        p.error("--engines must be 1..8, --requests at least --engines, --concurrency at least 1")
    print(f"host: {describe()}")
    for row in run(ns.quick, engines=ns.engines, n=ns.requests, seeds=ns.seeds, concurrency=ns.concurrency):
        target = f"<= {row['target']}" if row["target"] else ""
        print(f"{row['name']:40s} {row['ratio']:6.3f} {target:8s} {row['detail']}")


if __name__ == "__main__":
    main()

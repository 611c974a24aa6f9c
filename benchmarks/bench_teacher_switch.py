"""Teacher switches per rollout (slime's completion order vs teacher-grouped scoring) and the switch stall
with background prefetch vs a cold load (CPU, TeacherPool).

Switch order (row ``teacher_switch_order``): rollouts of samples routed to three switched teachers, whose
generation finishes in a random long-tailed order, are scored through the opd plugin's
:class:`~slime_ascend.opd.switching.SwitchGate` on one simulated engine (a switch sleeps ``switch_s``, a
scoring request ``score_s``) twice in one run: in completion order (each sample asks the gate as it finishes,
as the plugin did before) and grouped (:func:`~slime_ascend.opd.switching.score_grouped` on the rollout:
resident teacher first). Printed side by side: switches per rollout and wall seconds per rollout. Target:
grouped switches per rollout <= the teachers that rollout needs, every rollout.

Stall (row ``teacher_switch``):

Three teachers (>= 256 MiB of fp32 weights each; 32 MiB with --quick) are written as safetensors
to a temporary directory on local disk and deleted at the end. One in-process model is driven by
:class:`TorchModuleLoader` (CPU: ``load_state_dict(assign=True)``).

* cold: ``pool.activate(t)`` with nothing prefetched = safetensors read + hand-over. The files were
  just written, so the read is served from the page cache (dropping it needs root); a read from
  disk would only make the cold path slower, so the ratio below is conservative.
* prefetched: while the resident teacher "scores" (real forward passes on it, sharing the two
  CPU cores with the prefetch thread, for max(``score_factor`` x the median cold-load time,
  ``min_score_s`` = 0.5 s; real teacher scoring of a rollout batch takes far longer), the next
  teacher is staged in the background; the stall is the time spent inside ``pool.activate``,
  including any wait for a prefetch still in flight.

Repeats are interleaved (cold, prefetched, cold, ...); medians are compared.
Target: prefetched stall <= 10% of the cold-load time. Also reported: peak RSS growth sampled with
psutil (includes the safetensors mmap pages touched while reading) and the pool's own peak host
bytes counter (resident + prefetched teacher tensors).

Engine (row ``teacher_switch_engine``, ``--engine``; 1.1 GB fp32 Qwen3 teachers, 11 MB with --quick): three
teacher checkpoints on local disk, one torch engine (``slime-ascend serve-torch``, another process) switched
between them the ways the ``opd`` plugin can, interleaved:

* disk: ``/update_weights_from_disk`` of the next teacher's checkpoint, its files first dropped from the page
  cache (``posix_fadvise(DONTNEED)``, no root needed), so the engine reads them from disk as a first switch does;
* staged push (``ascend_opd_switch_transport: distributed``): the pool stages the next teacher in host memory
  while the resident one scores (real ``/generate`` requests to the engine for the window), then the switch
  pushes it over the engine's weight-update group; the stall is the time inside ``pool.activate``;
* staged hand-over (``ascend_opd_switch_transport: tensor``, row ``teacher_switch_engine_tensor``): the same, with
  the teacher staged in shared memory and handed to the engine by ``/update_weights_from_tensor`` with
  ``donate_tensors`` (the engine serves the shared memory as its weights, no copy); and the same without the field
  (row ``teacher_switch_engine_tensor_copied``: the engine copies the teacher into its weights, as SGLang does).

Printed: each switch's seconds, the medians, their ratio (staged / disk) per transport, the pool's peak host bytes,
the engine's served version after each switch and the seconds of a scoring request right after each switch (beside
those after a disk reload: the teacher as the switch left it serves as fast). Goal: <= 0.1 (over loopback gloo the
push still moves every byte through a socket during the switch; in shared memory the engine only checks the
teacher for NaN/inf).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime_ascend.opd.loaders import TorchModuleLoader  # noqa: E402
from slime_ascend.opd.pool import TeacherPool  # noqa: E402
from slime_ascend.opd.switching import SwitchGate, score_grouped  # noqa: E402

NAME = "teacher_switch"
TARGET = 0.10
ORDER_NAME = "teacher_switch_order"
TEACHERS = ("A", "B", "C")


async def _rollout_switches(routes: list[str], gen_s: list[float], grouped: bool, gate: SwitchGate,
                            engine: dict, score_s: float) -> float:
    """One rollout: samples finish generating after ``gen_s``; each is scored at its teacher. Returns its wall s."""
    t0 = time.perf_counter()

    async def score(name: str) -> None:
        assert engine["resident"] == name
        await asyncio.sleep(score_s)

    async def sample(name: str, delay: float) -> None:
        await asyncio.sleep(delay)
        if not grouped:
            async with gate.use(name):
                await score(name)

    await asyncio.gather(*(sample(n, d) for n, d in zip(routes, gen_s, strict=True)))
    if grouped:
        results = await score_grouped(gate, [(n, lambda n=n: score(n)) for n in routes])
        bad = [r for r in results if isinstance(r, Exception)]
        if bad:
            raise bad[0]
    return time.perf_counter() - t0


def switch_order(rollouts: int = 8, samples: int = 32, switch_s: float = 0.02, score_s: float = 0.001,
                 gen_s: float = 0.03, seed: int = 0) -> dict:
    """Switches per rollout and wall s per rollout, completion order vs grouped, on the same rollouts."""
    rng = random.Random(seed)
    plan = []
    for r in range(rollouts):  # each rollout leans to one teacher, cycling A -> B -> C -> A
        lean = TEACHERS[r % len(TEACHERS)]
        routes = [lean if rng.random() < 0.5 else rng.choice(TEACHERS) for _ in range(samples)]
        plan.append((routes, [gen_s * rng.lognormvariate(0, 0.8) for _ in range(samples)]))
    out: dict = {"needed": [len(set(routes)) for routes, _ in plan]}
    for grouped in (False, True):
        engine: dict = {"resident": None}

        async def switch(name: str, engine: dict = engine) -> None:
            await asyncio.sleep(switch_s)
            engine["resident"] = name

        async def run_all(engine: dict = engine, switch=switch) -> tuple[list[int], list[float]]:
            gate = SwitchGate(switch)
            counts, walls = [], []
            for routes, gens in plan:
                before = gate.switches
                walls.append(await _rollout_switches(routes, gens, grouped, gate, engine, score_s))
                counts.append(gate.switches - before)
            return counts, walls

        counts, walls = asyncio.run(run_all())
        out["grouped" if grouped else "completion"] = {"switches": counts, "wall_s": walls}
    return out


def order_row(quick: bool = False, rollouts: int | None = None, samples: int | None = None) -> dict:
    m = switch_order(rollouts=rollouts or (6 if quick else 10), samples=samples or (24 if quick else 48))
    c, g = m["completion"], m["grouped"]
    ok = all(n <= k for n, k in zip(g["switches"], m["needed"], strict=True))
    ratio = sum(g["switches"]) / max(1, sum(c["switches"]))
    detail = (
        f"switches per rollout ({len(TEACHERS)} switched teachers; teachers needed {m['needed']}):\n"
        f"  completion order  {c['switches']}  total {sum(c['switches'])}  wall {statistics.mean(c['wall_s']):.3f} s/rollout\n"
        f"  grouped           {g['switches']}  total {sum(g['switches'])}  wall {statistics.mean(g['wall_s']):.3f} s/rollout\n"
        f"  grouped/completion switches {ratio:.3f}; goal: grouped <= teachers needed in every rollout"
    )
    return {"name": ORDER_NAME, "ratio": ratio, "target": "<=needed", "passed": ok, "detail": detail}


def _model(width: int, layers: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def _write_teachers(root: Path, n: int, width: int, layers: int) -> list[dict]:
    from safetensors.torch import save_file

    specs = []
    for i in range(n):
        d = root / f"teacher{i}"
        d.mkdir()
        torch.manual_seed(i)
        state = {k: v.contiguous() for k, v in _model(width, layers).state_dict().items()}
        save_file(state, str(d / "model.safetensors"))
        del state
        specs.append({"name": f"teacher{i}", "checkpoint_dir": str(d), "domains": [f"d{i}"]})
    return specs


class _RssSampler:
    def __init__(self) -> None:
        import psutil

        self.proc = psutil.Process(os.getpid())
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self) -> _RssSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def _score(model: torch.nn.Module, width: int, seconds: float) -> int:
    x = torch.randn(8, width)
    n = 0
    end = time.perf_counter() + seconds
    with torch.no_grad():
        while time.perf_counter() < end:
            model(x)
            n += 1
    return n


def run(quick: bool = False, repeats: int | None = None, score_factor: float = 2.0, min_score_s: float = 0.5,
        order: bool = True) -> list[dict]:
    """Rows: the switch-order comparison (``order``), then the prefetched stall over a cold load."""
    rows = [order_row(quick)] if order else []
    return rows + _stall(quick, repeats, score_factor, min_score_s)


def _stall(quick: bool, repeats: int | None, score_factor: float, min_score_s: float) -> list[dict]:
    width, layers = (1024, 8) if quick else (2048, 16)  # 32 MiB / 256 MiB of fp32 per teacher
    repeats = repeats or (3 if quick else 5)
    teacher_bytes = width * width * layers * 4
    root = Path(tempfile.mkdtemp(prefix="bench_teacher_switch_", dir=os.environ.get("BENCH_TMPDIR")))
    try:
        specs = _write_teachers(root, 3, width, layers)
        names = [s["name"] for s in specs]
        model = _model(width, layers)
        cold: list[float] = []
        warm: list[float] = []
        kinds: list[str] = []
        with _RssSampler() as rss, TeacherPool(specs, TorchModuleLoader(model)) as pool:
            # warm-up: read every teacher once (first reads of freshly written files are erratic),
            # and calibrate the scoring window from these cold loads
            calib = [pool.activate(n).stall_s for n in names + names[:1]]
            order = iter(names[1:] + names * (2 * repeats + 2))
            score_s = max(min_score_s, score_factor * statistics.median(calib))
            for _ in range(repeats):
                c = pool.activate(next(order))
                assert c.prefetch == "miss"
                cold.append(c.stall_s)
                nxt = next(order)
                pool.prefetch(nxt)
                _score(model, width, score_s)
                w = pool.activate(nxt)
                warm.append(w.stall_s)
                kinds.append(w.prefetch)
                score_s = max(min_score_s, score_factor * statistics.median(cold))
            m = pool.metrics()
        cold_med, warm_med = statistics.median(cold), statistics.median(warm)
        ratio = warm_med / cold_med
        peak_rss_mib = (rss.peak - rss.base) / 2**20
        detail = (
            f"teacher={teacher_bytes / 2**20:.0f}MiB cold_median={cold_med * 1e3:.1f}ms "
            f"prefetched_median={warm_med * 1e3:.2f}ms (cold {[round(x * 1e3, 1) for x in cold]}, "
            f"prefetched {[round(x * 1e3, 2) for x in warm]}, kinds {kinds}) "
            f"pool_peak_host={m['peak_host_bytes'] / 2**20:.0f}MiB peak_rss_growth={peak_rss_mib:.0f}MiB "
            f"switches={int(m['switches'])} hits={int(m['prefetch_hits'])} late={int(m['prefetch_late'])} "
            f"score_window={score_s * 1e3:.0f}ms cold reads from page cache"
        )
        return [{"name": NAME, "ratio": ratio, "target": f"<={TARGET}", "passed": ratio <= TARGET, "detail": detail}]
    finally:
        shutil.rmtree(root, ignore_errors=True)


ENGINE_NAME = "teacher_switch_engine"


def _write_engine_teachers(root: Path, quick: bool) -> tuple[list[dict], int]:
    """Three Qwen3 teacher checkpoints (fp32, byte tokenizer) of one architecture; returns (specs, bytes each)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from slime_ascend.rollout.torch_engine.model import build_byte_tokenizer

    shape = (dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64) if quick else
             dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=6, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=128))
    config = Qwen3Config(vocab_size=1024, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, **shape)
    tokenizer = build_byte_tokenizer()
    specs, size = [], 0
    for i in range(3):
        torch.manual_seed(100 + i)
        model = Qwen3ForCausalLM(config).eval()
        d = root / f"teacher{i}"
        model.save_pretrained(str(d), safe_serialization=True)
        tokenizer.save_pretrained(str(d))
        size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        del model
        specs.append({"name": f"teacher{i}", "checkpoint_dir": str(d), "domains": [f"d{i}"]})
    return specs, size


def _drop_page_cache(directory: Path) -> None:
    for f in directory.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _post(url: str, payload: dict, timeout: float = 600) -> dict:
    from slime_ascend.json_client import request_json

    return request_json(url, payload, timeout_s=timeout)


def _score_once(url: str) -> None:
    """One scoring request: the log-probs of 256 prompt tokens, no new tokens."""
    _post(url + "/generate", {"input_ids": list(range(3, 3 + 256)), "return_logprob": True, "logprob_start_len": 0,
                              "sampling_params": {"max_new_tokens": 0}})


def _score_on_engine(url: str, seconds: float) -> int:
    """The resident teacher scores: /generate scoring requests for ``seconds``."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        _score_once(url)
        n += 1
    return n


def _first_scores(url: str, n: int = 3) -> float:
    """Seconds of each of the first ``n`` scoring requests after a switch (median): whether the teacher as the
    switch left it (copied, or adopted from the pool's shared memory) scores as fast as one loaded from disk."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        _score_once(url)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def engine_rows(quick: bool = False, repeats: int | None = None, min_score_s: float = 1.0) -> list[dict]:
    """Staged pushes (distributed, tensor) vs a disk reload of the same teachers on one torch engine (module
    docstring): one row per transport, each over the same disk reloads."""
    from slime_ascend.demo.slime_job import start_engine, stop
    from slime_ascend.opd.pool import TeacherPool
    from slime_ascend.opd.push_loader import DistributedPushLoader, TensorPushLoader

    repeats = repeats or (2 if quick else 3)
    root = Path(tempfile.mkdtemp(prefix="bench_teacher_switch_engine_", dir=os.environ.get("BENCH_TMPDIR")))
    engine = None
    try:
        specs, size = _write_engine_teachers(root, quick)
        names = [s["name"] for s in specs]
        dirs = {s["name"]: Path(s["checkpoint_dir"]) for s in specs}
        engine = start_engine(dirs[names[0]], root / "engine.log", timeout=600)
        url = engine.url
        serving = names[0]
        disk: list[float] = []
        ways = ("distributed", "tensor", "tensor_copied")
        stalls: dict[str, list[float]] = {way: [] for way in ways}
        scores: dict[str, list[float]] = {way: [] for way in ("disk", *ways)}
        versions: dict[str, list[str]] = {way: [] for way in ways}
        pools = {"distributed": TeacherPool(specs, DistributedPushLoader(url)),
                 "tensor": TeacherPool(specs, TensorPushLoader(url)),
                 "tensor_copied": TeacherPool(specs, TensorPushLoader(url, donate=False))}
        resident: dict[str, str | None] = {way: None for way in ways}
        try:
            for _ in range(repeats):
                target = next(n for n in names if n != serving)
                _drop_page_cache(dirs[target])
                t0 = time.perf_counter()
                answer = _post(url + "/update_weights_from_disk", {"model_path": str(dirs[target])})
                disk.append(time.perf_counter() - t0)
                assert answer.get("success"), answer
                scores["disk"].append(_first_scores(url))
                serving = target
                for way, pool in pools.items():
                    name = next(n for n in names if n not in (serving, resident[way]))
                    pool.prefetch(name)  # staged in host memory while the resident teacher scores
                    _score_on_engine(url, max(min_score_s, 2 * statistics.median(disk)))
                    info = pool.activate(name)
                    assert info.switched, info
                    stalls[way].append(info.stall_s)
                    scores[way].append(_first_scores(url))
                    versions[way].append(_post(url + "/get_weight_version", None)["weight_version"])
                    serving = resident[way] = name
            metrics = {way: pool.metrics() for way, pool in pools.items()}
        finally:
            for pool in pools.values():
                pool.close()
        disk_med = statistics.median(disk)
        rows = []
        for way, how in (("distributed", "pushed over the engine's weight-update group (gloo)"),
                         ("tensor", "handed over in shared memory (/update_weights_from_tensor, donated)"),
                         ("tensor_copied", "handed over in shared memory and copied (/update_weights_from_tensor "
                                           "without donate_tensors, as SGLang takes it)")):
            med = statistics.median(stalls[way])
            ratio = med / disk_med
            m = metrics[way]
            detail = (
                f"engine switch, teacher={size / 2**30:.2f} GiB fp32 on local disk: disk reload (page cache dropped) "
                f"{[round(x, 2) for x in disk]} s, median {disk_med:.2f} s; staged push (prefetched while scoring, "
                f"{how}) {[round(x, 2) for x in stalls[way]]} s, median {med:.2f} s; versions {versions[way]}; pool "
                f"peak host {m['peak_host_bytes'] / 2**30:.2f} GiB (one staged teacher: {size / 2**30:.2f}), read "
                f"{m['read_bytes'] / 2**30:.2f} GiB in {m['stage_s']:.1f} s of staging; a scoring request right after the "
                f"switch {statistics.median(scores[way]) * 1e3:.0f} ms (after a disk reload "
                f"{statistics.median(scores['disk']) * 1e3:.0f} ms); staged push / disk {ratio:.3f}"
            )
            rows.append({"name": ENGINE_NAME if way == "distributed" else f"{ENGINE_NAME}_{way}", "ratio": ratio,
                         "target": f"<={TARGET}", "passed": ratio <= TARGET, "detail": detail})
        return rows
    finally:
        if engine is not None:
            stop(engine.proc)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="32 MiB teachers instead of 256 MiB")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--order-only", action="store_true", help="only the switch-order comparison (no weights)")
    ap.add_argument("--rollouts", type=int, default=None, help="rollouts of the switch-order comparison")
    ap.add_argument("--samples", type=int, default=None, help="samples per rollout of the switch-order comparison")
    ap.add_argument("--engine", action="store_true", help="also the torch-engine rows: staged pushes vs disk reload "
                    "of 1.1 GB teachers (11 MB with --quick)")
    args = ap.parse_args()
    rows = [order_row(args.quick, args.rollouts, args.samples)]
    if not args.order_only:
        rows += run(quick=args.quick, repeats=args.repeats, order=False)
    if args.engine:
        rows += engine_rows(quick=args.quick, repeats=args.repeats)
    for row in rows:
        print(row["detail"])
        print(f"RESULT {row['name']} ratio={row['ratio']:.3f} target={row['target']} {'PASS' if row['passed'] else 'FAIL'}")


if __name__ == "__main__":
    main()

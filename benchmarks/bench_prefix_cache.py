"""Prefill tokens saved and time gained by the torch engine's prefix cache on multi-turn sessions (CPU).

A random Qwen3 (hidden 256, 4 layers, 8 heads, vocab 2048: big enough that a long prompt's prefill costs more
than the decode steps around it; 4 layers, hidden 128 with --quick) is saved to a temporary directory and served
in process by :class:`TorchEngine` three ways, each sent the same sessions, one turn of every session in turn
(round robin: the cache holds one entry per session), the three ways interleaved request by request:

* ``off``: no prefix cache (``--prefix-cache-tokens 0``, the default): every turn prefills its whole history;
* ``owner``: one engine with the cache; each session's later turn reuses the KV its last turn left;
* ``moved``: two engines with the cache, turn ``t`` of a session sent to engine ``t % 2``: every turn lands on
  the engine that did not serve the last one and finds only the turn before that (what a router that ignores the
  session's owner gives).

A session: a system prompt of ``prompt`` tokens, then per turn ``new`` greedy tokens (``ignore_eos``) and a user
message of ``user`` tokens. Reported: the fraction of prompt tokens reused (``cached_tokens`` summed over the
prompt tokens), the time of all turns off over owner (the speedup), and moved's fraction. Checked, not timed: owner
and moved give the same token ids as off (greedy). Target: owner reuses >= 80% of prompt tokens and runs >= 1.5x
faster than off (not judged with --quick). One torch thread by default (``--threads``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _host import describe  # noqa: E402
from slime_ascend.rollout.torch_engine.engine import TorchEngine  # noqa: E402
from slime_ascend.rollout.torch_engine.model import save_model, tiny_qwen3_config  # noqa: E402

NAME = "prefix_cache"
TARGET_SAVED = 0.80
TARGET_SPEEDUP = 1.5


def _model_dir(root: Path, quick: bool) -> Path:
    from transformers import AutoModelForCausalLM

    width = 128 if quick else 256
    config = tiny_qwen3_config(vocab_size=2048, hidden_size=width, intermediate_size=3 * width, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=4, head_dim=width // 8,
                               max_position_embeddings=8192)
    torch.manual_seed(0)
    return save_model(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), root / "model")


def _sessions(n: int, prompt: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 2000, (prompt,), generator=g).tolist() for _ in range(n)]


def _measure(quick: bool, sessions: int, turns: int, prompt: int, new: int, user: int) -> dict[str, dict]:
    """The three ways interleaved request by request (each turn of each session goes to off, owner and moved in
    turn), so a change of the host's load falls on all three; each generate call timed on its own."""
    with tempfile.TemporaryDirectory(prefix="bench-prefix-cache-") as tmp:
        model = str(_model_dir(Path(tmp), quick))
        cache = 2 * sessions * (prompt + turns * (new + user))  # every session's history fits
        engines = {"off": [TorchEngine(model)], "owner": [TorchEngine(model, prefix_cache_tokens=cache)],
                   "moved": [TorchEngine(model, prefix_cache_tokens=cache) for _ in range(2)]}
        sampling = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
        for way in engines.values():  # warm-up (kernels, allocator) on a prompt no session starts with
            for engine in way:
                engine.generate({"input_ids": [1] * 8, "sampling_params": {**sampling, "max_new_tokens": 2}})
        starts = _sessions(sessions, prompt)
        results = {way: {"seconds": 0.0, "prompt_tokens": 0, "cached": 0, "outputs": [[] for _ in starts],
                         "histories": [list(s) for s in starts]} for way in engines}
        g = torch.Generator().manual_seed(1)
        for turn in range(turns):
            for i in range(sessions):
                user_tokens = torch.randint(3, 2000, (user,), generator=g).tolist()
                for way, result in results.items():
                    engine = engines[way][turn % len(engines[way])]  # moved: the other engine each turn
                    history = result["histories"][i]
                    started = time.perf_counter()
                    answer = engine.generate({"input_ids": history, "sampling_params": sampling})
                    result["seconds"] += time.perf_counter() - started
                    result["prompt_tokens"] += answer["meta_info"]["prompt_tokens"]
                    result["cached"] += answer["meta_info"]["cached_tokens"]
                    result["outputs"][i].append(answer["output_ids"])
                    result["histories"][i] = history + answer["output_ids"] + user_tokens
    return results


def run(quick: bool = False, sessions: int = 4, turns: int | None = None, prompt: int | None = None,
        new: int = 16, user: int = 64, threads: int = 1) -> list[dict]:
    turns = turns or (3 if quick else 8)
    prompt = prompt or (128 if quick else 1024)
    load = os.getloadavg()[0]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # restored after: run_all runs the other benchmarks in this process
    try:
        results = _measure(quick, sessions, turns, prompt, new, user)
    finally:
        torch.set_num_threads(before)
    off, owner, moved = results["off"], results["owner"], results["moved"]
    for way, result in (("owner", owner), ("moved", moved)):
        if result["outputs"] != off["outputs"]:
            raise AssertionError(f"prefix cache ({way}): greedy token ids differ from no cache")
    saved = owner["cached"] / owner["prompt_tokens"]
    speedup = off["seconds"] / owner["seconds"]
    where = (f"{sessions} sessions x {turns} turns, system prompt {prompt}, {new} new + {user} user tokens a turn; "
             f"{threads} torch thread(s); host {describe()}, 1-minute load {load:.1f}")
    judge = (lambda ok: None) if quick else bool  # --quick: too few turns for the targets (rows only)
    return [
        {"name": f"{NAME}/owner_saved_fraction", "ratio": saved, "target": f">={TARGET_SAVED}",
         "passed": judge(saved >= TARGET_SAVED),
         "detail": f"{owner['cached']} of {owner['prompt_tokens']} prompt tokens reused; {where}"},
        {"name": f"{NAME}/off_over_owner_seconds", "ratio": speedup, "target": f">={TARGET_SPEEDUP}",
         "passed": judge(speedup >= TARGET_SPEEDUP),
         "detail": f"off {off['seconds']:.2f} s, owner {owner['seconds']:.2f} s, moved {moved['seconds']:.2f} s"},
        {"name": f"{NAME}/moved_saved_fraction", "ratio": moved["cached"] / moved["prompt_tokens"], "target": "-",
         "passed": None,
         "detail": f"{moved['cached']} of {moved['prompt_tokens']} prompt tokens reused (owner: {owner['cached']})"},
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller model and fewer, shorter turns")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=None, help="turns a session (default 8; 3 with --quick)")
    ap.add_argument("--prompt", type=int, default=None, help="system prompt tokens (default 1024; 128 with --quick)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: on a shared host, two "
                    "threads that wait for each other measure the other jobs)")
    args = ap.parse_args()
    if not 1 <= args.sessions <= 64 or (args.turns is not None and not 1 <= args.turns <= 64):
        ap.error("--sessions and --turns must be 1..64")
    print(f"host: {describe()}", flush=True)
    for row in run(args.quick, sessions=args.sessions, turns=args.turns, prompt=args.prompt, threads=args.threads):
        verdict = "SKIP" if row["passed"] is None else "PASS" if row["passed"] else "FAIL"
        print(f"{row['name']} {row['ratio']:.3f} {row['target']} {verdict} | {row['detail']}", flush=True)


if __name__ == "__main__":
    main()

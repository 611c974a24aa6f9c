"""slime's ``policy_loss_function`` with our DIS (and IcePop) TIS hook vs without any TIS, same batch (CPU).

Both sides run slime's own ``policy_loss_function`` forward + backward on the same packed logits and
loss batch; ours adds ``--use-tis`` with ``custom_tis_function_path=slime_ascend.hooks.tis_function``
and the ``dis`` (or ``icepop``) plugin, the baseline is plain PPO. The vocabulary is kept small
(1024) so the log-softmax does not hide the hook's cost. Target: ours/baseline <= 1.2.
One intra-op thread on both sides (``--threads``) for a stable like-for-like number.

Needs real THUDM/slime (``/opt/slime-src`` or installed) and megatron-core; otherwise it prints the
reason and reports the rows as skipped.

Run: ``python benchmarks/bench_dis_loss.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TARGET = 1.2


def _import_slime():
    for path in (None, "/opt/slime-src"):
        if path is not None and path not in sys.path:
            sys.path.append(path)
        try:
            import torch.distributed as dist
            from megatron.core import parallel_state as mpu
            from slime.backends.megatron_utils.cp_utils import get_sum_of_sample_mean
            from slime.backends.megatron_utils.loss import policy_loss_function

            if not dist.is_initialized():
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = sock.getsockname()[1]
                dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
            if not mpu.model_parallel_is_initialized():
                mpu.initialize_model_parallel(1, 1)
            return policy_loss_function, get_sum_of_sample_mean
        except Exception as e:  # noqa: BLE001 - any failure means "no slime here"
            reason = f"{type(e).__name__}: {e}"
    raise RuntimeError(reason)


def _args(plugin: str | None) -> argparse.Namespace:
    from slime_ascend.offpolicy.plugin import DIS, ICEPOP

    values = dict(
        use_rollout_logprobs=False, advantage_estimator="grpo", log_probs_chunk_size=-1, allgather_cp=False,
        rollout_temperature=1.0, entropy_coef=0.0, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None, use_opsm=False,
        get_mismatch_metrics=False, use_tis=False, custom_tis_function_path=None, tis_clip=2.0, tis_clip_low=0.0,
        calculate_per_token_loss=False, use_kl_loss=False, rollout_top_p=1.0, loss_type="policy_loss",
    )
    if plugin is not None:
        p = {"dis": DIS, "icepop": ICEPOP}[plugin]
        values.update({s.key: s.default for s in p.settings})
        values.update(dict(p.slime_args))
        values.update(ascend_plugins=[plugin], custom_tis_function_path="slime_ascend.hooks.tis_function")
    return argparse.Namespace(**values)


def _batch(n: int, resp: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rl = [resp] * n
    tl = [r + 256 for r in rl]
    tokens = [torch.randint(0, vocab, (t,), generator=g) for t in tl]
    logits = torch.randn(1, sum(tl), vocab, generator=g)
    masks = [torch.ones(r, dtype=torch.int32) for r in rl]
    old = [-torch.rand(r, generator=g) * 3 - 5 for r in rl]
    batch = {
        "advantages": [torch.randn(r, generator=g) for r in rl],
        "log_probs": old,
        "rollout_log_probs": [o + 0.3 * torch.randn(o.shape, generator=g) for o in old],
        "unconcat_tokens": tokens, "response_lengths": rl, "total_lengths": tl, "loss_masks": masks,
        "rollout_mask_sums": torch.tensor([float(r) for r in rl]),
    }
    return logits, batch


def _step(policy_loss_function, get_sum_of_sample_mean, args, logits, batch) -> None:
    x = logits.clone().requires_grad_(True)
    reducer = get_sum_of_sample_mean(batch["total_lengths"], batch["response_lengths"], batch["loss_masks"],
                                     batch["rollout_mask_sums"], False)
    loss, _ = policy_loss_function(args, batch, x, reducer)
    loss.backward()


def run(quick: bool = False, threads: int = 1) -> list[dict]:
    try:
        policy_loss_function, get_sum_of_sample_mean = _import_slime()
    except RuntimeError as e:
        print(f"SKIP bench_dis_loss: real slime/megatron not importable ({e})")
        return [{"name": f"{p}_tis_vs_policy_loss", "ratio": None, "target": f"<={TARGET}", "passed": None,
                 "detail": f"skipped: slime not importable ({e})"} for p in ("dis", "icepop")]
    torch.set_num_threads(threads)
    n, resp, vocab, repeats = (4, 1024, 1024, 7) if quick else (16, 2048, 1024, 11)
    logits, batch = _batch(n, resp, vocab)
    base_args = _args(None)
    rows = []
    for plugin in ("dis", "icepop"):
        ours_args = _args(plugin)
        os.environ["SLIME_ASCEND_PLUGINS"] = plugin
        from slime_ascend.plugins import runtime

        runtime.reset()
        for args in (ours_args, base_args):  # warm-up
            _step(policy_loss_function, get_sum_of_sample_mean, args, logits, batch)
        t_ours, t_base = [], []
        for _ in range(repeats):  # interleaved
            for args, bucket in ((ours_args, t_ours), (base_args, t_base)):
                t0 = time.perf_counter()
                _step(policy_loss_function, get_sum_of_sample_mean, args, logits, batch)
                bucket.append(time.perf_counter() - t0)
        ours, base = statistics.median(t_ours), statistics.median(t_base)
        ratio = ours / base
        passed = ratio <= TARGET
        detail = (f"{n}x{resp} response tokens, vocab {vocab}, {threads} thread(s): ours {ours * 1e3:.1f} ms, "
                  f"plain policy_loss_function {base * 1e3:.1f} ms (median of {repeats}, fwd+bwd)")
        print(f"RESULT {plugin}_tis_vs_policy_loss ratio={ratio:.2f} target=<={TARGET} {'PASS' if passed else 'FAIL'}"
              f"  ({detail})")
        rows.append({"name": f"{plugin}_tis_vs_policy_loss", "ratio": ratio, "target": f"<={TARGET}",
                     "passed": passed, "detail": detail})
    os.environ.pop("SLIME_ASCEND_PLUGINS", None)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller batch")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads on both sides")
    ns = parser.parse_args()
    run(quick=ns.quick, threads=ns.threads)

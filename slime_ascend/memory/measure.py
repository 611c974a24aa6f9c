"""Check the ledger against a real training step on this CPU.

:func:`measure_train_step` runs, in a fresh Python process, one training step of the tiny Qwen3 of
``slime_ascend.rollout.reference.model`` (``load_model(None)``, fp32, Adam, the loss on
``log_softmax(logits)`` as slime's policy loss computes it) on one packed micro-batch of ``tokens`` tokens,
and reports the step's peak resident memory above the memory held just before it:

* before the step: a warm-up step on 16 tokens has allocated the parameters, the gradients (kept, as
  Megatron's grad buffer is) and Adam's moments, and loaded every kernel; the process's peak RSS is then
  reset (``/proc/self/clear_refs`` = 5) and its RSS read (``baseline``);
* after the step: peak RSS (``VmHWM``) - ``baseline`` = what the step itself added: saved activations,
  logits, backward temporaries, inputs. Model state and the Python/torch runtime are in the baseline, so
  both sides leave them out.

glibc's ``malloc`` is pinned to ``mmap`` for blocks over 64 KiB (``MALLOC_MMAP_THRESHOLD_``) so freed tensors
go back to the OS and RSS follows the live tensors; one intra-op thread. :func:`compare` sets the ledger's
``actor`` objects with lifetime ``train step`` (same model, fp32, TP = PP = 1, the same tokens, no allocator
margin) against that number. Linux only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

_CHILD = r"""
import json, os, sys
import torch
torch.set_num_threads(1)
from slime_ascend.rollout.reference.model import load_model

def rss():
    with open("/proc/self/status") as f:
        d = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f if l.startswith(("VmRSS", "VmHWM"))}
    return d["VmRSS"], d["VmHWM"]

tokens = int(sys.argv[1])
model = load_model(None).train()
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
vocab = model.config.vocab_size

def step(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, n), generator=g)
    logits = model(input_ids=ids).logits
    logp = torch.log_softmax(logits.float(), dim=-1)
    loss = -logp[0, :-1].gather(-1, ids[0, 1:, None]).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return float(loss)

step(16, 0)
step(16, 1)
import gc; gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base, _ = rss()
step(tokens, 2)
_, peak = rss()
params = sum(p.numel() for p in model.parameters())
print(json.dumps({"tokens": tokens, "baseline_rss": base, "peak_rss": peak, "step_bytes": peak - base,
                  "params": params, "torch": torch.__version__}))
"""


@dataclass
class Comparison:
    tokens: int
    estimate_bytes: float
    measured_bytes: int
    baseline_rss: int
    params: int

    @property
    def relative_error(self) -> float:
        """(estimate - measured) / measured."""
        return (self.estimate_bytes - self.measured_bytes) / self.measured_bytes

    def line(self) -> str:
        mib = 1024**2
        return (f"tiny Qwen3 train step, {self.tokens} tokens, fp32 on CPU: ledger estimate "
                f"{self.estimate_bytes / mib:.1f} MiB, measured peak RSS above the pre-step baseline "
                f"{self.measured_bytes / mib:.1f} MiB (baseline {self.baseline_rss / mib:.0f} MiB: runtime + model "
                f"state), relative error {self.relative_error:+.1%}")


def measure_train_step(tokens: int, timeout: float = 600) -> dict:
    """Run the step in a fresh process (see the module docstring); returns its JSON report."""
    if not os.path.exists("/proc/self/clear_refs"):
        raise RuntimeError("the measurement needs Linux's /proc/self/clear_refs")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_ARENA_MAX="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tokens)], capture_output=True, text=True, env=env,
                         timeout=timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"measurement process failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def estimate_train_step(tokens: int) -> float:
    """The ledger's ``train step`` objects of the actor for the tiny Qwen3 in fp32 (model state excluded)."""
    from ..rollout.reference.model import TINY_QWEN3_KWARGS
    from .ledger import Layout, build_ledger

    cfg = dict(TINY_QWEN3_KWARGS, model_type="qwen3")
    lay = Layout(max_tokens_per_gpu=tokens, seq_length=tokens, param_dtype="fp32", grad_dtype="fp32",
                 reference=False, margin=0.0, kv_cache_tokens=1)
    led = build_ledger(cfg, lay)
    return led.total("actor", lifetime="train step")


def compare(tokens: int = 4096) -> Comparison:
    rep = measure_train_step(tokens)
    return Comparison(tokens, estimate_train_step(tokens), rep["step_bytes"], rep["baseline_rss"], rep["params"])


if __name__ == "__main__":
    for n in (int(a) for a in (sys.argv[1:] or ["4096"])):
        print(compare(n).line())

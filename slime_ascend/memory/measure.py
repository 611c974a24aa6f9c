"""The ledger against slime's own Megatron train actor, measured on this CPU.

:func:`measure` runs slime's ``train.py`` (from :func:`slime_ascend.demo.slime_job.slime_src`) with the ``cpu``
plugin on a dense Qwen3 HF checkpoint, train-only: ``--load-debug-rollout-data`` feeds it rollouts written
here with slime's own ``save_debug_rollout_data`` (no rollout engine; slime then sets ``debug_train_only``),
one rollout per token count, so one Ray start measures several micro-batch sizes. Every rollout is three
train steps of one micro-batch each (``--use-dynamic-batch-size``; 4 samples of ``tokens / 4`` tokens, packed
by slime into one THD micro-batch of ``tokens`` tokens). :mod:`.probe`, slime's before-train-step hook
inside the actor, records the actor's RSS and peak RSS at the start of every step; the measured figure of a
rollout is the peak during its step 1 minus the RSS at its start: what the step adds on top of the model
state and the runtime, which are both in that baseline. Step 0 is not used (Adam's moments are allocated by
the first optimizer step). glibc's ``malloc`` is pinned to ``mmap`` for blocks over 64 KiB
(``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the resident set and RSS follows the live tensors.

:func:`ledger_for` is the ledger of the same job (TP = PP = 1, bf16 params, fp32 main grads, the cpu spec's
kernels, no reference, no allocator margin); :class:`Comparison` sets its actor ``train step`` objects against
the measured step, and its model state against what :func:`.probe.model_state_bytes` counted on Megatron's
tensors. Run ``python -m slime_ascend.memory.measure`` for the table of the two models of the tests.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .ledger import Layout, ModelShape, build_ledger, param_count

MIB = 1024**2
SAMPLES_PER_STEP = 4
STEPS_PER_ROLLOUT = 3
MEASURED_STEP = 1
PROMPT_TOKENS = 16
HOOK = "slime_ascend.memory.probe.before_train_step"

# the two models of the tests: the tiny Qwen3 of the e2e tests, and a wider, deeper one with a larger vocab
SMALL = "tiny-qwen3"
LARGER = "qwen3-h256-l4"
MODELS: dict[str, dict[str, Any]] = {
    SMALL: {},  # slime_ascend.rollout.torch_engine.model.TINY_QWEN3_KWARGS
    LARGER: dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=4096, max_position_embeddings=8192),
}


class CannotMeasure(ValueError):
    """This host cannot run the measurement for the asked job (one line, with the fix)."""


def qwen3_arch_flags(cfg: dict[str, Any]) -> list[str]:
    """Megatron's architecture flags of a dense Qwen3 HF config (slime's ``scripts/models/qwen3-*.sh``)."""
    m = ModelShape.from_hf(cfg)
    flags = (f"--swiglu --num-layers {m.layers} --hidden-size {m.hidden} --ffn-hidden-size {m.ffn} "
             f"--num-attention-heads {m.heads} --group-query-attention --num-query-groups {m.kv_heads} "
             f"--use-rotary-position-embeddings --disable-bias-linear --normalization RMSNorm "
             f"--norm-epsilon {cfg.get('rms_norm_eps', 1e-6):g} --rotary-base {cfg.get('rope_theta', 10000):g} "
             f"--vocab-size {m.vocab} --kv-channels {m.head_dim} --qk-layernorm"
             + ("" if m.tied else " --untie-embeddings-and-output-weights"))
    return shlex.split(flags)


def check_measurable(cfg: dict[str, Any], lay: Layout) -> None:
    """What the cpu plugin can train, as one ``CannotMeasure`` naming the field and the fix."""
    m = ModelShape.from_hf(cfg)
    if not m.model_type.startswith("qwen3") or m.experts or m.mla or m.index_heads:
        raise CannotMeasure(f"--measure runs dense Qwen3 models only (config model_type {m.model_type!r}). Fix: drop "
                            "--measure, or pass a dense qwen3 config")
    for name in ("tp", "pp", "cp", "ep", "dp"):
        if getattr(lay, name) != 1:
            raise CannotMeasure(f"--measure runs one CPU train actor (--{name} {getattr(lay, name)}). Fix: drop "
                                f"--measure, or pass --{name} 1")
    if lay.recompute != "none" or lay.param_dtype != "bf16" or lay.grad_dtype != "fp32":
        raise CannotMeasure("--measure runs slime's defaults here (no recompute, bf16 params, fp32 grads). Fix: drop "
                            "--measure, or drop --recompute / --param-dtype / --grad-dtype")
    if lay.tokens % SAMPLES_PER_STEP or lay.tokens // SAMPLES_PER_STEP <= PROMPT_TOKENS:
        raise CannotMeasure(f"--measure packs {SAMPLES_PER_STEP} samples into one micro-batch of --max-tokens-per-gpu "
                            f"tokens; {lay.tokens} is too small or not a multiple of {SAMPLES_PER_STEP}. Fix: pass "
                            f"e.g. --max-tokens-per-gpu 2048")


def check_host_fits(cfg: dict[str, Any], tokens: list[int]) -> None:
    """Refuse a job whose ledger peak (+ 2 GiB for the driver, Ray and the runtime) exceeds 80% of
    ``MemAvailable``, or whose step would take hours on this host (over 2e13 training FLOPs a run)."""
    lay = ledger_layout(max(tokens))
    peak = build_ledger(cfg, lay).peak("actor")[0]
    avail = _mem_available()
    if avail and peak + 2 * 1024**3 > 0.8 * avail:
        raise CannotMeasure(f"the model is too large for this host: the actor's peak is about {peak / 1024**3:.1f} "
                            f"GiB, {avail / 1024**3:.1f} GiB is available. Fix: measure a smaller config or fewer "
                            f"--max-tokens-per-gpu")
    flops = 6 * param_count(ModelShape.from_hf(cfg)) * sum(tokens) * (STEPS_PER_ROLLOUT + 1)
    if flops > 2e13:
        raise CannotMeasure(f"the model is too large for this host: the measurement is {flops:.1e} training FLOPs "
                            f"on the CPU (limit 2e13). Fix: measure a smaller config or fewer --max-tokens-per-gpu")


def _mem_available() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def ledger_layout(tokens: int) -> Layout:
    """The measured job's layout: one rank, ``tokens`` per micro-batch (sequences of ``tokens / 4``), bf16
    params with fp32 main grads, no reference, the cpu spec's kernels, no allocator margin."""
    return Layout(max_tokens_per_gpu=tokens, seq_length=tokens // SAMPLES_PER_STEP, reference=False, margin=0.0,
                  kv_cache_tokens=1, kernels="cpu")


def ledger_for(cfg: dict[str, Any], tokens: int):
    return build_ledger(cfg, ledger_layout(tokens))


def model_config(model: str | dict[str, Any]) -> dict[str, Any]:
    """The HF config of a model of :data:`MODELS` (the tiny Qwen3's fields, overridden), or ``model`` itself."""
    if isinstance(model, dict):
        return model
    from ..rollout.torch_engine.model import TINY_QWEN3_KWARGS

    return dict(TINY_QWEN3_KWARGS, **MODELS[model], model_type="qwen3")


def preflight(cfg: dict[str, Any], tokens: list[int], src: Path | None = None) -> Path:
    """Every refusal before anything runs (Linux, slime, what the cpu plugin trains, the host's size);
    returns slime's source tree."""
    from ..demo.slime_job import SlimeNotFound, slime_src

    if not os.path.exists("/proc/self/clear_refs"):
        raise CannotMeasure("--measure reads the train actor's peak RSS from Linux's /proc. Fix: run it on Linux")
    for n in tokens:
        check_measurable(cfg, ledger_layout(n))
    check_host_fits(cfg, tokens)
    try:
        return src or slime_src()
    except SlimeNotFound as exc:
        raise CannotMeasure(f"--measure needs slime: {exc}. Fix: set SLIME_SRC to a THUDM/slime clone") from None


def make_checkpoint(cfg: dict[str, Any], out_dir: Path) -> tuple[Path, dict[str, Any]]:
    """A random Qwen3 HF checkpoint of ``cfg`` (bf16, a byte-level tokenizer of its vocab) and its config.json."""
    import torch

    from ..rollout.torch_engine.model import build_byte_tokenizer, save_model, tiny_qwen3_config

    overrides = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype", "dtype",
                                                             "transformers_version", "_name_or_path")}
    if not (out_dir / "config.json").is_file():
        from transformers import AutoModelForCausalLM

        config = tiny_qwen3_config(**overrides)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(torch.bfloat16)
        model.config.torch_dtype = torch.bfloat16
        save_model(model, out_dir, build_byte_tokenizer(config.vocab_size))
    return out_dir, json.loads((out_dir / "config.json").read_text())


def write_rollouts(directory: Path, tokens: list[int], vocab: int) -> str:
    """One rollout file per token count, written by slime's ``save_debug_rollout_data``: ``STEPS_PER_ROLLOUT *
    SAMPLES_PER_STEP`` samples of ``tokens / SAMPLES_PER_STEP`` tokens (a 16-token prompt, the rest response),
    rewards 0/1 alternating. Returns slime's ``--load-debug-rollout-data`` path template."""
    import torch

    from slime.observability.rollout_data_utils import save_debug_rollout_data
    from slime.utils.types import Sample

    template = str(directory / "rollout_{rollout_id}.pt")
    gen = torch.Generator().manual_seed(0)
    for rid, total in enumerate(tokens):
        length = total // SAMPLES_PER_STEP
        samples = []
        for i in range(STEPS_PER_ROLLOUT * SAMPLES_PER_STEP):
            ids = torch.randint(3, vocab, (length,), generator=gen).tolist()
            resp = length - PROMPT_TOKENS
            samples.append(Sample(group_index=i // 2, index=i, prompt="measure", tokens=ids, response_length=resp,
                                  response="x", label="0", reward=float(i % 2), loss_mask=[1] * resp,
                                  status=Sample.Status.COMPLETED))
        save_debug_rollout_data(template, samples, rollout_id=rid, evaluation=False)
    return template


def job_flags(model_dir: Path, cfg: dict[str, Any], work: Path, tokens: list[int], template: str) -> list[str]:
    """slime's ``train.py`` flags of the measurement job (GRPO, one CPU actor, train-only)."""
    prompts = work / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "measure", "label": "0"}) + "\n")
    per_rollout = STEPS_PER_ROLLOUT * SAMPLES_PER_STEP
    longest = max(tokens) // SAMPLES_PER_STEP
    flags = f"""
      --hf-checkpoint {model_dir} --load {model_dir}
      --prompt-data {prompts} --input-key prompt --label-key label --rm-type random
      --num-rollout {len(tokens)} --rollout-batch-size {per_rollout // 2} --n-samples-per-prompt 2
      --rollout-max-response-len {longest} --global-batch-size {SAMPLES_PER_STEP} --micro-batch-size 1
      --use-dynamic-batch-size --max-tokens-per-gpu {max(tokens)}
      --seq-length {longest} --max-position-embeddings {max(longest, cfg.get('max_position_embeddings', 0))}
      --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28
      --optimizer adam --lr 1e-5 --lr-decay-style constant --weight-decay 0.0 --adam-beta1 0.9 --adam-beta2 0.98
      --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1
      --actor-num-nodes 1 --actor-num-gpus-per-node 1 --rollout-num-gpus 1 --rollout-num-gpus-per-engine 1
      --load-debug-rollout-data {template}
      --custom-megatron-before-train-step-hook-path {HOOK}
      --attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32
      --attention-softmax-in-fp32 --bf16 --seed 1234
    """
    return shlex.split(flags) + qwen3_arch_flags(cfg)


@dataclass
class Measured:
    """One rollout's measurement: the step's peak RSS above its start, the start RSS, the model state counted."""

    tokens: int
    step_bytes: int
    baseline_rss: int
    model_state_bytes: int


def read_probe(path: Path, tokens: list[int]) -> list[Measured]:
    """The measured step of each rollout from the probe's lines (one train actor)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    pids = {r["pid"] for r in rows}
    if len(pids) != 1:
        raise RuntimeError(f"the probe saw {len(pids)} train processes; the measurement runs one")
    at = {(r["rollout"], r["step"]): r for r in rows}
    out = []
    for rid, n in enumerate(tokens):
        start, end = at.get((rid, MEASURED_STEP)), at.get((rid, MEASURED_STEP + 1))
        if start is None or end is None:
            raise RuntimeError(f"rollout {rid}: the probe has no steps {MEASURED_STEP} and {MEASURED_STEP + 1} "
                               f"(lines: {sorted(at)})")
        out.append(Measured(n, end["hwm"] - start["rss"], start["rss"], sum(start["model_state"].values())))
    return out


def measure(model: str | dict[str, Any], tokens: list[int], work: Path | None = None, timeout: float = 900,
            src: Path | None = None) -> tuple[dict[str, Any], list[Measured], Path]:
    """Run the measurement job (module docstring) for ``model`` (a name of :data:`MODELS` or an HF config
    dict) at each of ``tokens`` (tokens per micro-batch); returns (config, one :class:`Measured` per token
    count, the job's directory: the checkpoint, the rollouts, slime's log ``train.log``, ``probe.jsonl``)."""
    from ..demo.slime_job import run_slime

    src = preflight(model_config(model), tokens, src)
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))  # write_rollouts uses slime's own writer
    work = Path(tempfile.mkdtemp(prefix="slime-ascend-memory-")) if work is None else Path(work)
    model_dir, cfg = make_checkpoint(model_config(model), work / "model")
    rollouts = work / "rollouts"
    rollouts.mkdir(exist_ok=True)
    template = write_rollouts(rollouts, tokens, cfg["vocab_size"])
    probe = work / "probe.jsonl"
    if probe.exists():
        raise CannotMeasure(f"{work} already holds a probe.jsonl (an earlier measurement). Fix: pass an empty "
                            "work directory")
    env = {"SLIME_ASCEND_MEMORY_PROBE": str(probe), "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "2"}
    run = run_slime("train.py", job_flags(model_dir, cfg, work, tokens, template), work, ("cpu",),
                    extra_env=env, timeout=timeout, src=src)
    if run.returncode != 0:
        raise RuntimeError(f"slime's train.py failed ({run.returncode}); log {work / 'train.log'}:\n{run.log[-4000:]}")
    return cfg, read_probe(probe, tokens), work


@dataclass
class Comparison:
    model: str
    measured: Measured
    estimate_bytes: float          # the ledger's actor objects of lifetime "train step"
    model_state_estimate: float    # the ledger's actor model state
    work: Path | None = None

    @property
    def ratio(self) -> float:
        """ledger / measured, for the step."""
        return self.estimate_bytes / self.measured.step_bytes

    @property
    def model_state_ratio(self) -> float:
        return self.model_state_estimate / self.measured.model_state_bytes

    def row(self) -> str:
        m = self.measured
        return (f"| {self.model} | {m.tokens:,} | {m.step_bytes / MIB:.1f} | {self.estimate_bytes / MIB:.1f} | "
                f"{self.ratio:.3f} | {m.model_state_bytes / MIB:.2f} | {self.model_state_estimate / MIB:.2f} | "
                f"{m.baseline_rss / MIB:.0f} |")


HEADER = ("| model | tokens/step | measured step MiB | ledger step MiB | ratio | model state MiB (counted) | "
          "ledger model state MiB | baseline RSS MiB |\n|---|---|---|---|---|---|---|---|")


def compare(model: str | dict[str, Any], tokens: list[int], **kw: Any) -> list[Comparison]:
    cfg, measured, work = measure(model, tokens, **kw)
    name = model if isinstance(model, str) else str(cfg.get("_name_or_path") or cfg.get("model_type"))
    out = []
    for m in measured:
        led = ledger_for(cfg, m.tokens)
        out.append(Comparison(name, m, led.total("actor", lifetime="train step"),
                              led.total("actor", category="model state"), work))
    return out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    print(f"host: {cpu_name()}, {os.cpu_count()} cores")
    print(HEADER)
    for name in (SMALL, LARGER):
        for c in compare(name, [2048, 8192]):
            print(c.row(), flush=True)

"""``slime-ascend memory``: the memory ledger of a slime job, per role, from a model config and a layout.

    slime-ascend memory --config CONFIG_JSON_OR_HF_DIR [--tp N --pp N --cp N --ep N --dp N]
        [--max-tokens-per-gpu N | --micro-batch-size N --seq-length N] [--recompute full|selective|none]
        [--kv-cache-tokens N | --mem-fraction F --device-gib G] [--teachers N --teacher-config C]
        [--sync-format none|fp8-block|int8-w8a8|int4-group] [--qat none|int4-group|...] [--kernels fused|cpu]
        [--slime-args "..."] [--json] [--measure]

``--slime-args`` takes the layout from a slime command line (the flags slime and Megatron use); flags given
here as well win. No torch is imported, except by ``--measure``: it runs the measurement job of
:mod:`.measure` (slime's ``train.py`` with the ``cpu`` plugin, this host) for the config at the layout's tokens
per micro-batch and prints the measured train-step memory next to the ledger's (one line where it cannot:
no slime, a layout or model the cpu plugin does not train, a model too large for the host).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from collections.abc import Sequence
from dataclasses import fields, replace

from ..command import ArgumentParser
from .ledger import KERNELS, RECOMPUTE, SYNC_FORMATS, Layout, ModelShape, build_ledger, format_table

# slime / Megatron flag -> Layout field (value flags)
SLIME_FLAGS: dict[str, str] = {
    "--tensor-model-parallel-size": "tp", "--pipeline-model-parallel-size": "pp",
    "--context-parallel-size": "cp", "--expert-model-parallel-size": "ep",
    "--max-tokens-per-gpu": "max_tokens_per_gpu", "--micro-batch-size": "micro_batch_size",
    "--seq-length": "seq_length", "--recompute-granularity": "recompute",
    "--rollout-num-gpus-per-engine": "rollout_tp", "--sglang-mem-fraction-static": "mem_fraction",
    "--update-weight-buffer-size": "sync_bucket_bytes", "--sglang-chunked-prefill-size": "chunked_prefill_tokens",
}


def _layout_from_slime(text: str) -> tuple[dict, str | None]:
    """Layout fields (and ``--hf-checkpoint``) from a slime command line; DP = actor GPUs / (TP*PP*CP)."""
    try:
        tokens = shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"--slime-args is not a valid shell command line ({exc}). Fix: quote it as one string") from None
    out: dict = {}
    hf = None
    nodes, gpus = 1, None
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        flag, _, inline = tok.partition("=")
        val = inline if inline else (tokens[i + 1] if i + 1 < len(tokens) else "")
        step = 1 if inline else 2
        if flag in SLIME_FLAGS:
            key = SLIME_FLAGS[flag]
            try:
                out[key] = val if key == "recompute" else (float(val) if key == "mem_fraction" else int(val))
            except ValueError:
                raise ValueError(f"--slime-args: {flag} {val!r} is not a number. Fix: correct it in the slime "
                                 f"command line") from None
            i += step
        elif flag == "--hf-checkpoint":
            hf, i = val, i + step
        elif flag == "--actor-num-nodes":
            nodes, i = int(val), i + step
        elif flag == "--actor-num-gpus-per-node":
            gpus, i = int(val), i + step
        elif flag in ("--fp16",):
            out["param_dtype"], i = "fp16", i + 1
        elif flag == "--grad-reduce-in-bf16":
            out["grad_dtype"], i = "bf16", i + 1
        elif flag == "--no-sequence-parallel":
            out["sequence_parallel"], i = False, i + 1
        elif flag == "--enable-mtp-training":
            out["mtp_training"], i = True, i + 1
        elif flag == "--sglang-speculative-algorithm":  # the model's own MTP layers draft (SGLang's NEXTN / EAGLE)
            out["rollout_mtp"], i = str(val).upper() in ("NEXTN", "EAGLE", "EAGLE3"), i + step
        elif flag == "--use-critic" or (flag == "--advantage-estimator" and val == "ppo"):
            out["critic"] = True
            i += 1 if flag == "--use-critic" else step
        else:
            i += 1
    if gpus is not None:
        world = nodes * gpus
        split = out.get("tp", 1) * out.get("pp", 1) * out.get("cp", 1)
        if world % split:
            raise ValueError(f"--slime-args: actor GPUs {world} are not a multiple of TP*PP*CP = {split}. Fix: correct "
                             f"--actor-num-gpus-per-node or the parallel sizes")
        out["dp"] = world // split
    if out.get("recompute") not in (None, *RECOMPUTE):
        raise ValueError(f"--slime-args: --recompute-granularity {out['recompute']!r} is not known. Fix: use full or "
                         f"selective")
    return out, hf


def _read_config(path: str, flag: str = "--config") -> dict:
    """The model config ``path`` names (``flag``: the option that named it), with every field the ledger reads
    checked here, where the error can name the file."""
    from ..files import read_json_object

    p = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(p):
        raise ValueError(f"{flag} {path!r}: {p} does not exist. Fix: pass an HF config.json or the checkpoint "
                         f"directory that holds one")
    try:  # a regular file of at most 16 MiB (a FIFO or /dev/zero is refused before it is read)
        cfg = read_json_object(p)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag}: {exc}. Fix: pass an HF config.json") from None
    try:
        ModelShape.from_hf(cfg)
    except (ValueError, TypeError) as exc:  # a field missing or of the wrong type (a list where a number goes)
        text = " ".join(str(exc).split()).rstrip(".")
        raise ValueError(f"{flag} {p}: {text}" + ("" if "Fix:" in text else ". Fix: correct that field of the "
                         "config (an HF config.json of a decoder-only model)")) from None
    return cfg


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="slime-ascend memory",
                       description="Peak memory of each role of a slime job (actor, critic, reference, rollout, "
                                   "teachers), object by object, for a model config and a parallel layout.")
    p.add_argument("--config", help="HF config.json, or a checkpoint directory holding one (or --hf-checkpoint in "
                                    "--slime-args)")
    p.add_argument("--slime-args", metavar="CMDLINE",
                   help="a slime command line to take the layout from (--tensor-model-parallel-size, "
                        "--max-tokens-per-gpu, --recompute-granularity, --actor-num-gpus-per-node, ...)")
    for flag, help_ in (("--tp", "tensor parallel size"), ("--pp", "pipeline parallel size"),
                        ("--cp", "context parallel size"), ("--ep", "expert parallel size"),
                        ("--dp", "data parallel size"), ("--max-tokens-per-gpu", "tokens per micro-batch per GPU"),
                        ("--micro-batch-size", "sequences per micro-batch (without --max-tokens-per-gpu)"),
                        ("--seq-length", "longest sequence"), ("--num-microbatches", "micro-batches per step"),
                        ("--rollout-tp", "rollout engine TP (slime's --rollout-num-gpus-per-engine)"),
                        ("--kv-cache-tokens", "KV pool tokens per engine (default: from --mem-fraction)"),
                        ("--teachers", "OPD teacher engines"), ("--teacher-tp", "teacher engine TP"),
                        ("--sync-bucket-bytes", "slime's --update-weight-buffer-size (default 512 MiB)"),
                        ("--chunked-prefill-tokens", "SGLang chunked prefill size (default 8192)"),
                        ("--running-requests", "SGLang decode batch (default 256)")):
        p.add_argument(flag, type=int, default=None, help=help_)
    p.add_argument("--recompute", default=None, help="full|selective|none (default none)")
    p.add_argument("--sync-format", default=None, help=f"weight-sync quantisation: {'|'.join(SYNC_FORMATS)}")
    p.add_argument("--qat", default=None, help=f"the qat plugin's fake-quant format: {'|'.join(SYNC_FORMATS)} "
                                               "(default none)")
    p.add_argument("--param-dtype", default=None, help="bf16|fp16|fp32 (default bf16)")
    p.add_argument("--grad-dtype", default=None, help="fp32|bf16 (default fp32 main_grad)")
    p.add_argument("--kv-dtype", default=None, help="bf16|fp8|fp32 (default bf16)")
    p.add_argument("--attention", default=None, help="flash|eager (default flash)")
    p.add_argument("--kernels", default=None, help=f"{'|'.join(KERNELS)}: the device's fused kernels (default), or "
                                                   "those of the cpu plugin's spec")
    p.add_argument("--mem-fraction", type=float, default=None, help="SGLang mem fraction static (default 0.8)")
    p.add_argument("--device-gib", type=float, default=None, help="device memory in GiB (default 64)")
    p.add_argument("--margin", type=float, default=None, help="allocator margin, fraction of the peak (default 0.1)")
    p.add_argument("--teacher-config", help="the teachers' HF config (default: the model's)")
    # the switches default to None ("not given"), so that only a switch given here overrides --slime-args
    p.add_argument("--critic", action="store_true", default=None, help="a PPO critic")
    p.add_argument("--mtp-training", action="store_true", default=None,
                   help="the MTP layers train on the last stage (slime's --enable-mtp-training)")
    p.add_argument("--rollout-mtp", action="store_true", default=None,
                   help="the engines draft with the MTP layers (--sglang-speculative-algorithm NEXTN or EAGLE)")
    p.add_argument("--no-reference", dest="reference", action="store_false", default=None, help="no reference model")
    p.add_argument("--no-distributed-optimizer", dest="distributed_optimizer", action="store_false", default=None)
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false", default=None)
    p.add_argument("--json", action="store_true", help="print the ledger as JSON")
    p.add_argument("--measure", action="store_true",
                   help="also run the job's train actor on this host (slime's train.py, cpu plugin) and print its "
                        "measured train-step memory next to the estimate")
    return p


def layout_from_args(ns: argparse.Namespace) -> tuple[Layout, str | None]:
    values: dict = {}
    hf = None
    if ns.slime_args:
        values, hf = _layout_from_slime(ns.slime_args)
    names = {f.name for f in fields(Layout)}
    for key, val in vars(ns).items():
        if key in names and val is not None:
            values[key] = val
    return Layout(**values), hf


def main(argv: Sequence[str] | None = None) -> int:
    """Run by ``slime-ascend memory`` inside the CLI's one error handler (a ValueError: one line, exit 2)."""
    ns = build_parser().parse_args(argv)
    layout, hf = layout_from_args(ns)
    path = ns.config or hf
    if not path:
        raise ValueError("no model config. Fix: pass --config CONFIG_JSON_OR_HF_DIR (or --hf-checkpoint in "
                         "--slime-args)")
    cfg = _read_config(path, "--config" if ns.config else "--hf-checkpoint (in --slime-args)")
    teacher = _read_config(ns.teacher_config, "--teacher-config") if ns.teacher_config else None
    led = build_ledger(cfg, layout, teacher)
    measured = _measure(cfg, layout) if ns.measure else None
    if ns.json:
        print(json.dumps(led.to_dict() | ({"measured": measured} if measured else {}), indent=2))
    else:
        print(format_table(led))
        if measured:
            print(_measured_line(measured))
    return 0


def _measure(cfg: dict, layout: Layout) -> dict:
    """The measurement of :mod:`.measure` for ``cfg`` at ``layout.tokens``, the ledger of that job (cpu
    kernels) and the same step's ledger with the device's fused kernels."""
    from . import measure

    measure.check_measurable(cfg, layout)  # before any output: a refusal is the one line
    measure.preflight(cfg, [layout.tokens])
    try:
        c = measure.compare(cfg, [layout.tokens])[0]
    except RuntimeError as exc:
        raise ValueError(f"--measure: {str(exc).splitlines()[0]}. Fix: read the job's log named there") from None
    fused = build_ledger(cfg, replace(layout, kernels="fused", margin=0.0))
    return {"host": measure.cpu_name(), "tokens": c.measured.tokens, "step_bytes": c.measured.step_bytes,
            "ledger_step_bytes": int(c.estimate_bytes), "ratio": round(c.ratio, 4),
            "model_state_bytes": c.measured.model_state_bytes, "ledger_model_state_bytes": int(c.model_state_estimate),
            "baseline_rss": c.measured.baseline_rss,
            "fused_ledger_step_bytes": int(fused.total("actor", lifetime="train step")), "job_dir": str(c.work)}


def _measured_line(d: dict) -> str:
    mib = 1024**2
    return (f"measured on this host ({d['host']}), slime's train actor with the cpu plugin, {d['tokens']:,} tokens "
            f"per step: {d['step_bytes'] / mib:.1f} MiB peak RSS above the step's start; ledger (cpu kernels) "
            f"{d['ledger_step_bytes'] / mib:.1f} MiB, ratio {d['ratio']:.3f}; model state counted "
            f"{d['model_state_bytes'] / mib:.2f} MiB, ledger {d['ledger_model_state_bytes'] / mib:.2f} MiB; the "
            f"same step with the device's fused kernels: {d['fused_ledger_step_bytes'] / mib:.1f} MiB (job files: "
            f"{d['job_dir']})")

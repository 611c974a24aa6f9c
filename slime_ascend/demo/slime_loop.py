"""``slime-ascend demo --slime-src DIR``: the demo's plugins inside slime's own ``train_async.py``.

The same task as the miniature loop (:mod:`.task`: the tiny Qwen3 policy that knows the digits task
but hedges, two domain-expert teachers of the same origin, the digits environment with long
episodes that need compaction), the same plugins, run by stock slime on this CPU with the ``cpu``
plugin: RayTrainGroup, the RolloutManager, slime's sglang router, a Megatron actor (and critic, for
SAO), weight updates to the torch engine through ``--update-weight-transport disk``.

Everything reported comes from slime's own output: the metric dicts slime logs per rollout and per
train step (``rollout N: {...}``, ``step N: {...}``, ``perf N: {...}``), its log lines and the files
it writes. ``metrics.jsonl`` has one line per rollout with the miniature loop's keys where slime has
the same quantity (``reward``, ``mismatch``, ``masked_frac``, ...) and slime's own dicts beside them;
``summary.json`` has ``"loop": "slime"`` and, per plugin, the evidence found in slime's output.

``--model glm5`` (:data:`MODEL_JOBS`): the same task on the tiny GLM-5 (:mod:`slime_ascend.glm5.tiny`: MoE,
MLA, DSA with IndexShare) built by slime's own spec, ``slime_plugins.models.glm5.glm5 get_glm5_spec`` (the
``cpu`` plugin's glm5 patches give it its host parts), with ``dsa-determinism`` added and fp32 training;
``summary.json``'s ``model_evidence`` is the spec Megatron's argument dump shows and the glm5 patches applied.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..cpu.plugin import SPEC as CPU_SPEC
from ..glm5.tiny import TINY_GLM5_ARGS
from ..plugins.base import option_groups
from .loop import DemoConfig, prepare_task, task_settings, write_yaml
from .plots import plot_curves
from .slime_job import (
    TINY_QWEN3_ARGS,
    Engine,
    SlimeNotFound,
    job_env,
    parse_rollout_metrics,
    slime_src,
    start_engine,
    stop,
)

__all__ = ["MODEL_JOBS", "SLIME_DEPENDENCIES", "ModelJob", "missing_dependencies", "model_evidence", "resolve_slime",
           "run_slime_demo"]

# what slime's train_async.py imports on the path the demo runs, beyond slime itself
SLIME_DEPENDENCIES = ("ray", "megatron.training", "sglang", "sglang_router", "transformers")


def missing_dependencies() -> list[str]:
    from ..host import module_installed

    return [name for name in SLIME_DEPENDENCIES if not module_installed(name)]


def resolve_slime(explicit: str | None) -> tuple[Path | None, str]:
    """``(slime source tree, "")`` when the demo can run in slime's loop, else ``(None, why not)``."""
    try:
        src = slime_src(explicit)
    except SlimeNotFound as exc:
        return None, str(exc)
    missing = missing_dependencies()
    if missing:
        return None, (f"slime at {src} needs {', '.join(missing)} (not importable here); install slime's "
                      "dependencies as docs/cpu.md says")
    return src, ""


def _without_spec(flags: tuple[str, ...] | list[str]) -> tuple[list[str], tuple[str, ...]]:
    """(the architecture flags less ``--spec MODULE FUNCTION``, that spec)."""
    flags = list(flags)
    if "--spec" not in flags:
        return flags, ()
    at = flags.index("--spec")
    return flags[:at] + flags[at + 3:], tuple(flags[at + 1:at + 3])


@dataclasses.dataclass(frozen=True)
class ModelJob:
    """What ``--model`` changes in the slime job: the architecture flags, the spec (empty: the ``cpu`` plugin's),
    plain slime arguments set in the YAML (applied after slime's own rules) and the demo's base flags it drops.
    Every model runs every plugin the demo is asked for."""

    arch: tuple[str, ...]
    spec: tuple[str, ...] = ()
    slime_args: tuple[tuple[str, Any], ...] = ()
    drop_flags: tuple[str, ...] = ()


_GLM5_ARCH, _GLM5_SPEC = _without_spec(TINY_GLM5_ARGS)
MODEL_JOBS: dict[str, ModelJob] = {
    "qwen3": ModelJob(arch=tuple(TINY_QWEN3_ARGS.split())),
    # fp32 (bf16: false after slime's bf16 = not fp16), as slime's glm5 spec trains on this host in
    # tests/e2e/test_slime_glm5_cpu.py; the spec replaces the cpu plugin's local one
    "glm5": ModelJob(arch=tuple(_GLM5_ARCH), spec=_GLM5_SPEC, slime_args=(("bf16", False),), drop_flags=("--bf16",)),
}
_SPEC_LINE = re.compile(r"\bspec \.+ (\[[^\]\n]*\])[ \t]*$", re.MULTILINE)


def model_evidence(model: str, log: str) -> dict[str, Any]:
    """The model slime trained, from its log: the specs in Megatron's argument dumps (one per train actor:
    the policy and SAO's critic) and, for GLM-5, the cpu plugin's glm5 patches applied."""
    import ast

    specs: list[list[str]] = []
    for match in _SPEC_LINE.finditer(log):
        try:
            spec = [str(x) for x in ast.literal_eval(match.group(1))]
        except (ValueError, SyntaxError):
            continue
        if spec not in specs:
            specs.append(spec)
    expected = list(MODEL_JOBS[model].spec or CPU_SPEC.split())  # a model without its own: the cpu plugin's
    return {"name": model, "spec": expected, "logged_specs": specs, "spec_in_log": specs == [expected],
            "glm5_patches": sorted(set(re.findall(r"applied runtime patch (train\.glm5_\w+)", log)))}


@dataclasses.dataclass
class _Job:
    """What the plugins add to the slime job: YAML values, command-line flags, engines to stop."""

    out: Path
    paths: dict[str, str]
    yaml: dict[str, Any] = dataclasses.field(default_factory=dict)
    flags: dict[str, str | None] = dataclasses.field(default_factory=dict)  # flag -> value (None: a switch)
    engines: list[Engine] = dataclasses.field(default_factory=list)


def _prompt_rows(cfg: DemoConfig, rollouts: int) -> list[dict[str, Any]]:
    """The task's episodes as slime prompt-data rows (``metadata`` carries the task and the domain)."""
    from .task import answer_for, make_episodes, question_text

    rows = []
    for step in range(rollouts):
        rng = random.Random(cfg.seed * 7919 + step)
        for i, ep in enumerate(make_episodes(rng, cfg.batch, cfg.long_fraction, cfg.fillers)):
            task = ep.to_task()
            rows.append({"prompt": question_text(ep.domain, ep.digit), "label": answer_for(ep.domain, ep.digit),
                         "metadata": {"domain": ep.domain, "task": task, "seed": cfg.seed * 1_000_003 + step * 997 + i}})
    return rows


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    return path


def _base_flags(cfg: DemoConfig, job: _Job, engine: Engine) -> dict[str, str | None]:
    p = job.paths
    return {
        "--hf-checkpoint": p["policy"], "--load": p["policy"], "--save": str(job.out / "slime_ckpt"),
        "--save-interval": "100000",
        "--prompt-data": p["prompts"], "--input-key": "prompt", "--label-key": "label", "--metadata-key": "metadata",
        "--num-rollout": str(cfg.steps), "--rollout-batch-size": str(cfg.batch), "--n-samples-per-prompt": "1",
        "--global-batch-size": str(cfg.batch), "--micro-batch-size": "1",
        "--rollout-max-response-len": str(cfg.max_new_tokens), "--rollout-max-context-len": str(cfg.context_budget),
        "--rollout-temperature": "1.0", "--rollout-seed": str(cfg.seed),
        "--seq-length": "512", "--max-position-embeddings": "4096",
        "--eps-clip": "0.2", "--optimizer": "adam", "--lr": str(cfg.lr), "--lr-decay-style": "constant",
        "--weight-decay": "0.0", "--adam-beta1": "0.9", "--adam-beta2": "0.98",
        "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "1", "--context-parallel-size": "1",
        "--actor-num-nodes": "1", "--actor-num-gpus-per-node": "1", "--rollout-num-gpus": "1",
        "--rollout-num-gpus-per-engine": "1",
        "--rollout-external-engine-addrs": engine.addr,
        "--update-weight-mode": "full", "--update-weight-transport": "disk",
        "--update-weight-disk-dir": str(job.out / "weights"),
        "--attention-dropout": "0.0", "--hidden-dropout": "0.0", "--accumulate-allreduce-grads-in-fp32": None,
        "--attention-softmax-in-fp32": None, "--bf16": None, "--seed": str(cfg.seed),
        "--custom-rm-path": "slime_ascend.demo.task.async_task_reward",
    }


# -- per plugin: what it adds to the job ---------------------------------------------------------------
def _setup_sao(cfg: DemoConfig, job: _Job) -> None:
    from slime_ascend.sao.role_config import write_megatron_role_config

    role_config = job.out / "sao_megatron.yaml"
    # the critic saves beside the actor's --save, not over it (slime saves each role to its own args.save)
    write_megatron_role_config(str(role_config), ["self_attention"], force=True,
                               save=str(job.out / "slime_ckpt_critic"))
    job.flags["--megatron-config-path"] = str(role_config)
    job.flags["--critic-lr"] = str(cfg.critic_lr)
    job.yaml.update(ascend_sao_freeze_patterns=["self_attention"])


def _setup_opd(cfg: DemoConfig, job: _Job) -> None:
    teacher = start_engine(Path(job.paths["copy"]), job.out / "teacher_engine.log")
    job.engines.append(teacher)
    job.yaml.update(task_settings("opd", cfg, job.paths, teacher.url))


def _setup_task(plugin: str) -> Callable[[DemoConfig, _Job], None]:
    """A plugin whose only addition is the task's YAML values (compaction, staleness)."""
    def setup(cfg: DemoConfig, job: _Job) -> None:
        job.yaml.update(task_settings(plugin, cfg, job.paths, ""))

    return setup


# the checkpoint format each sync plugin pushes; the engine serves (and --hf-checkpoint names) a checkpoint
# of that format, made by `slime-ascend quantize` from the policy, as a user of the plugin does
SYNC_FORMATS = {"int8-sync": "int8-w8a8", "fp8-sync": "fp8-block"}


def _setup_sync(plugin: str) -> Callable[[DemoConfig, _Job], None]:
    def setup(cfg: DemoConfig, job: _Job) -> None:
        fmt = SYNC_FORMATS[plugin]
        quantized = job.out / "checkpoints" / f"policy_init_{fmt}"
        cmd = [sys.executable, "-m", "slime_ascend.cli", "quantize", job.paths["policy"], str(quantized),
               "--format", fmt, "--force"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(cmd)} failed: {proc.stderr.strip()[-2000:]}")
        job.paths["engine_checkpoint"] = str(quantized)
        job.flags["--hf-checkpoint"] = str(quantized)  # --load stays the BF16 policy Megatron trains

    return setup


SETUPS: dict[str, Callable[[DemoConfig, _Job], None]] = {
    "sao": _setup_sao, "compaction": _setup_task("compaction"), "opd": _setup_opd,
    "staleness": _setup_task("staleness"),
    **{plugin: _setup_sync(plugin) for plugin in SYNC_FORMATS},
}

# per plugin: the metric keys (prefixes) in slime's logged dicts that are its evidence (keys slime logs
# whatever the plugins, such as perf/update_weights_time, are not evidence of anything)
EVIDENCE_METRICS: dict[str, tuple[str, ...]] = {
    "sao": ("train/critic-", "rollout/values", "rollout/gae_lambdas", "train/dis_"),
    "compaction": ("rollout/round_number", "rollout/compaction_"),
    "opd": ("rollout/opd_", "rollout/teacher_log_probs"),
    "staleness": ("rollout/staleness_",),
    "tito": ("rollout/tito_",),
    "int8-sync": ("perf/weight_sync_",),
    "fp8-sync": ("perf/weight_sync_",),
    "dis": ("train/dis_",),
    "icepop": ("train/icepop",),
}
# per plugin: lines of slime's log (or, for the sync plugins, of the rollout engine's log) that are its evidence
EVIDENCE_LOG: dict[str, tuple[str, ...]] = {
    "cpu": (r"applied runtime patch (?:driver\.ray_cpu_resources|train\.cpu_\w+)", r"backend=gloo"),
    "sao": (r"applied runtime patch train\.critic_\w+",),
    # the train side's indexer selects with the deterministic top-k (installed as slime's indexer is imported)
    "dsa-determinism": (r"applied runtime patch train\.dsa_deterministic_topk",),
    # the gate's checks at slime's parse_args (the driver and the RolloutManager), before the first rollout
    "verifier-gate": (r"verifier gate: [^\n]*? passes oracle, no_action and unfinished \(\d+ cases\)",),
}
EVIDENCE_ENGINE_LOG: dict[str, tuple[str, ...]] = {
    "int8-sync": (r"loaded weight version \d+ from \S+ \(int8[^)]*\)",),
    "fp8-sync": (r"loaded weight version \d+ from \S+ \(fp8[^)]*\)",),
}


def plugin_evidence(plugins: tuple[str, ...], steps: dict[int, dict[str, Any]], log: str,
                    engine_log: str = "") -> dict[str, Any]:
    """Per plugin: the matching metric series from slime's dicts and up to five matching log lines."""
    out: dict[str, Any] = {}
    for plugin in plugins:
        prefixes = EVIDENCE_METRICS.get(plugin, ())
        series: dict[str, list[Any]] = {}
        for step in sorted(steps):
            for key, value in steps[step].items():
                if prefixes and key.startswith(prefixes):
                    series.setdefault(key, []).append(value)
        lines: list[str] = []
        for text, table in ((log, EVIDENCE_LOG), (engine_log, EVIDENCE_ENGINE_LOG)):
            for pattern in table.get(plugin, ()):
                lines += [m.group(0)[:200] for m in re.finditer(pattern, text)]
        entry: dict[str, Any] = {"metrics": series, "log": sorted(set(lines))[:5]}
        if plugin == "sao":  # how many critic updates slime logged per rollout (``critic-step N: {...}`` lines)
            passes = re.findall(r"critic-step (\d+): \{", log)
            entry["critic_passes_per_rollout"] = dict(Counter(int(n) for n in passes))
        entry["found"] = bool(series or lines)
        out[plugin] = entry
    return out


def _history_row(step: int, m: dict[str, Any]) -> dict[str, Any]:
    """One metrics.jsonl line: the miniature loop's keys where slime logs the same quantity, then slime's dict."""
    def first(*keys: str) -> Any:
        return next((m[k] for k in keys if k in m), None)

    return {
        "step": step,
        "reward": first("rollout/raw_reward", "rollout/rewards"),
        "mismatch": first("train/train_rollout_logprob_abs_diff"),
        "masked_frac": first("train/dis_masked_frac", "train/icepop_masked_frac"),
        "kl": first("rollout/opd_kl", "rollout/opd_reverse_kl"),  # the teacher KL only (the plot's panel)
        "staleness_drops": first("rollout/staleness_dropped", "rollout/staleness_drops"),
        "slime": m,
    }


def run_slime_demo(cfg: DemoConfig, src: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the demo's plugins in slime's ``train_async.py``; returns the summary (also ``summary.json``)."""
    t_start = time.perf_counter()
    out = Path(cfg.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = MODEL_JOBS[cfg.model]
    # the verifier gate always: slime's parse_args checks every verifier the job trains with before its first rollout
    plugins = ("cpu", *[p for p in cfg.plugins if p not in ("cpu", "verifier-gate")], "verifier-gate")
    log(f"slime-ascend demo in slime's own loop ({src / 'train_async.py'}): model {cfg.model}"
        + (f" (spec {' '.join(model.spec)})" if model.spec else "") + f"; plugins {', '.join(plugins)}; "
        f"seed {cfg.seed}; {cfg.steps} rollouts; output {out}"
        + (f"; layout {' '.join(layout_words)}" if (layout_words := _layout_words(cfg)) else ""))
    paths, start, seconds = prepare_task(cfg, out)
    log(f"prepared the initial policy and two teachers in {seconds:.1f}s")
    (out / "weights").mkdir(exist_ok=True)
    paths["prompts"] = str(_write_jsonl(out / "prompts.jsonl", _prompt_rows(cfg, cfg.steps)))
    job = _Job(out, paths)
    summary: dict[str, Any] = {"loop": "slime", "slime_src": str(src), "model": cfg.model, "plugins": list(plugins),
                               "layout": layout_words,
                               "seed": cfg.seed, "steps_requested": cfg.steps,
                               "interrupted": False, "start_answer_probs": start}
    run_log = out / "train_async.log"
    metrics_path = out / "metrics.jsonl"
    metrics_path.write_text("")
    rc = None
    # SIGTERM acts as Ctrl-C: the engines and slime's process group are stopped, not left running
    previous_sigterm = signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    try:
        for plugin in plugins:
            if plugin in SETUPS:
                t0 = time.perf_counter()
                SETUPS[plugin](cfg, job)
                log(f"set up {plugin} in {time.perf_counter() - t0:.1f}s")
        t0 = time.perf_counter()
        engine = start_engine(Path(job.paths.get("engine_checkpoint", paths["policy"])), out / "engine.log")
        log(f"torch engine for the rollouts at {engine.addr} in {time.perf_counter() - t0:.1f}s")
        job.engines.append(engine)
        generated = write_yaml(plugins, job.yaml, out / "ascend.yaml", dict(model.slime_args))
        # the demo's values, its parallel layout, then the plugins' other flags
        own = {**_base_flags(cfg, job, engine), **layout_flags(cfg), **job.flags}
        cmd = slime_command(src, cfg.model, own, generated.flags, out / "ascend.yaml")
        (out / "command.txt").write_text(shlex.join(cmd) + "\n")
        log(f"running slime's train_async.py (log: {run_log}); one line per rollout as slime logs it")
        rc = _run_streaming(cmd, job_env(plugins, ray_resources(cfg, plugins), src=src), out, run_log, metrics_path,
                            cfg.steps, log)
    except KeyboardInterrupt:
        summary["interrupted"] = True
        log("interrupted: slime stopped; metrics written so far are kept")
    finally:
        for eng in job.engines:
            stop(eng.proc)
        signal.signal(signal.SIGTERM, previous_sigterm)
    text = run_log.read_text(errors="replace") if run_log.exists() else ""
    steps = parse_rollout_metrics(text)
    history = [_history_row(s, steps[s]) for s in sorted(steps)]
    _write_jsonl(metrics_path, history)
    summary["returncode"] = rc
    summary["steps_done"] = sum(1 for h in history if "train/step" in h["slime"])
    rewards = [h["reward"] for h in history if h["reward"] is not None]
    if rewards:
        k = max(1, min(5, len(rewards) // 3))
        summary["reward_first"], summary["reward_last"] = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    engine_log = (out / "engine.log").read_text(errors="replace") if (out / "engine.log").exists() else ""
    summary["evidence"] = plugin_evidence(plugins, steps, text, engine_log)
    summary["plugins_without_evidence"] = [p for p, e in summary["evidence"].items() if not e["found"]]
    summary["model_evidence"] = model_evidence(cfg.model, text)
    if history and rewards:
        summary["plot"] = plot_curves([h for h in history if h["reward"] is not None], str(out / "curves.png"),
                                      title=f"slime's train_async.py on this CPU, {cfg.model}: {', '.join(plugins)}")
    summary["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if rc not in (0, None):
        tail = "\n".join(text.splitlines()[-40:])
        log(f"slime's train_async.py exited with {rc}; the end of {run_log}:\n{tail}")
    else:
        log(f"\n{summary['steps_done']} train steps in slime's loop; evidence from slime's output for "
            + ", ".join(f"{p} ({'yes' if e['found'] else 'none'})" for p, e in summary["evidence"].items())
            + f"; model {cfg.model}, spec {' '.join(summary['model_evidence']['spec'])} "
            + ("in" if summary["model_evidence"]["spec_in_log"] else "NOT in") + " slime's log"
            + f"\nwrote {metrics_path}, {out / 'summary.json'}" + (f", {summary['plot']}" if "plot" in summary else "")
            + f" in {summary['elapsed_s']}s")
    return summary


def layout_flags(cfg: DemoConfig) -> dict[str, str | tuple[str, ...] | None]:
    """The demo's parallel layout (``--tp --pp --cp --ep --dp --sp --allgather-cp``) as slime's flags, what
    ``slime-ascend config ... --flags --tp N ...`` prints (flag -> value, None: a switch); {} for one rank. slime
    gives SAO's critic the actor's rank count and parallel sizes."""
    return {option: None if not values else values[0] if len(values) == 1 else tuple(values)
            for option, *values in option_groups(_layout_words(cfg))}


def _layout_words(cfg: DemoConfig) -> list[str]:
    return [] if cfg.layout is None or cfg.layout.is_default else cfg.layout.flags()


def ray_resources(cfg: DemoConfig, plugins: tuple[str, ...]) -> dict[str, str]:
    """``RAY_OVERRIDE_RESOURCES`` for the demo's job when its layout needs more logical CPUs than the default
    (``Layout.ray_cpus``: the actor's ranks and SAO's critic's, slime's RolloutManager and its lock, the rollout
    and teacher engine handles): the cpu plugin's Ray check would refuse the job otherwise. {}: the default
    suffices."""
    from ..parallel_layout import Layout
    from .slime_job import RAY_LOGICAL_CPUS

    needed = (cfg.layout or Layout()).ray_cpus(roles=2 if "sao" in plugins else 1, engines=2)
    if needed <= RAY_LOGICAL_CPUS:
        return {}
    return {"RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": needed, **({"NPU": needed} if "npu" in plugins else {})})}


def slime_command(src: Path, model: str, own: dict[str, str | None], plugin_flags: list[str], config_path: Path
                  ) -> list[str]:
    """slime's ``train_async.py`` command line: ``model``'s architecture flags (:data:`MODEL_JOBS`), the demo's
    flags ``own`` (flag -> value, None: a switch) less those the model drops, the model's spec, then the flags
    ``slime-ascend config`` printed (``plugin_flags``) that ``own`` and the spec do not set, then the YAML."""
    job = MODEL_JOBS[model]
    flags: dict[str, str | tuple[str, ...] | None] = {k: v for k, v in own.items() if k not in job.drop_flags}
    if job.spec:
        flags["--spec"] = job.spec  # in place of the cpu plugin's local spec
    words = [word for flag, value in flags.items()  # None: a switch; a tuple: several words
             for word in (flag, *(() if value is None else value if isinstance(value, tuple) else (value,)))]
    words += [word for option, *values in option_groups(plugin_flags) if option not in flags
              for word in (option, *values)]
    return [sys.executable, str(src / "train_async.py"), *job.arch, *words, "--custom-config-path", str(config_path)]


def _terminate_as_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


# (a line of slime's log, what it means): announced once each while slime starts, which takes a minute or
# more before the first rollout's metrics on a small host
MILESTONES = (
    ("Creating placement group", "Ray placement group requested"),
    ("RolloutManager", "rollout manager started"),
    ("slime accelerator in the actor train actor", "policy train actor up"),
    ("slime accelerator in the critic train actor", "critic train actor up"),
    ("'rollout/", "first rollout generated"),
)


def _run_streaming(cmd: list[str], env: dict[str, str], out: Path, run_log: Path, metrics_path: Path, steps: int,
                   log: Callable[[str], None]) -> int:
    """Run slime (its own process group) with its output in ``run_log``; echo one line per rollout as its
    metrics appear; stop the group on any exit (Ctrl-C, SIGTERM)."""
    seen: set[int] = set()
    milestones = list(MILESTONES)
    t0 = time.perf_counter()
    with run_log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=str(out),
                                text=True, errors="replace", start_new_session=True)
        try:
            assert proc.stdout is not None
            metric_lines = ""  # only slime's labelled metric lines: the rest of its log is never re-read
            for line in proc.stdout:
                fh.write(line)
                for milestone in [m for m in milestones if m[0] in line]:
                    milestones.remove(milestone)
                    log(f"  slime: {milestone[1]} ({time.perf_counter() - t0:.0f}s)")
                if ": {'" in line:
                    metric_lines += line
                if " step " in line and "'train/step'" in line:
                    parsed = parse_rollout_metrics(metric_lines)
                    for s in sorted(set(parsed) - seen):
                        if "train/step" in parsed[s]:
                            seen.add(s)
                            row = _history_row(s, parsed[s])
                            with metrics_path.open("a") as mf:
                                mf.write(json.dumps(row, default=str) + "\n")
                            log(_step_line(s, steps, row))
            return proc.wait()
        except BaseException:
            stop(proc)
            raise


def _step_line(step: int, steps: int, row: dict[str, Any]) -> str:
    def f(v: Any, fmt: str = "{:.3f}") -> str:
        return "-" if v is None else fmt.format(v)

    m = row["slime"]
    return (f"rollout {step + 1:>3}/{steps} | reward {f(row['reward'])} | mismatch {f(row['mismatch'], '{:.4f}')} | "
            f"masked {f(row['masked_frac'])} | grad norm {f(m.get('train/grad_norm'))} | "
            f"critic value loss {f(m.get('train/critic-value_loss'))} | "
            f"stale drops {f(row['staleness_drops'], '{:.0f}')} | teacher switches "
            f"{f(m.get('rollout/opd_pool/switches'), '{:.0f}')}")

"""The demo's closed loop on a local Ray cluster: rollout -> rewards -> train -> quantised weight sync.

:func:`run_demo` prepares the task's checkpoints, starts Ray (``num_cpus`` local cluster), starts a
rollout actor (engines + generation, :mod:`.rollout`) and a train actor (:mod:`.trainer`), and runs
slime's one-step-off-policy schedule (``train_async.py``): rollout ``t + 1`` is generated while
the trainer learns from rollout ``t``; then the engine loads the new weights (version ``t + 1``).
Each step appends one JSON line to ``metrics.jsonl``; the end writes ``summary.json``, the contract
report (``slime-ascend check``) and ``curves.png``. Ray is shut down on every exit, Ctrl-C included.

The slime ``args`` are an ``argparse.Namespace`` with slime's field names, plus the YAML that
``slime-ascend config <plugins>`` writes, loaded and set key by key as slime's
``--custom-config-path`` does (``out/ascend.yaml`` keeps the file used).

slime's own loop (:mod:`.slime_loop`) starts from the same :class:`DemoConfig`, :func:`prepare_task`,
:func:`task_settings` and :func:`write_yaml`.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_PLUGINS", "MODELS", "DemoConfig", "build_args", "default_plugins", "prepare_task", "run_demo",
           "task_settings", "write_yaml"]

DEFAULT_PLUGINS = ("sao", "compaction", "opd", "staleness", "int8-sync")
# the demo's models (``--model``): the tiny Qwen3 (dense; both loops) and the tiny GLM-5 (slime's own glm5 spec:
# MoE, MLA, DSA with IndexShare; slime's loop only), each with the plugins the demo runs on it by default
MODELS = ("qwen3", "glm5")
MODEL_PLUGINS: dict[str, tuple[str, ...]] = {"qwen3": DEFAULT_PLUGINS, "glm5": (*DEFAULT_PLUGINS, "dsa-determinism")}


def default_plugins(model: str) -> tuple[str, ...]:
    """The plugins the demo runs on ``model`` when ``--plugins`` is not given."""
    if model not in MODEL_PLUGINS:
        raise ValueError(f"--model {model!r} is not one of {', '.join(MODELS)}")
    return MODEL_PLUGINS[model]
SYNC_PLUGINS = {"int8-sync": "int8", "fp8-sync": "fp8"}


@dataclasses.dataclass
class DemoConfig:
    steps: int = 30
    plugins: tuple[str, ...] = DEFAULT_PLUGINS
    model: str = "qwen3"  # one of MODELS
    seed: int = 0
    out: str = "slime_ascend_demo"
    batch: int = 32  # rollouts per step (one sample per prompt, as SAO wants)
    long_fraction: float = 0.125
    fillers: tuple[int, int] = (2, 3)
    lr: float = 1e-3
    lr_warmup_steps: int = 3
    critic_lr: float = 3e-3
    max_new_tokens: int = 1
    context_budget: int = 192
    trigger_tokens: int = 64
    staleness_tau: int = 1
    opd_coef: float = 0.5
    opd_clip: float | None = 1.0
    late_long_episodes: bool = True
    overlap: bool = True  # train_async.py (next rollout overlaps training); False: train.py, on-policy
    num_cpus: int = 2
    concurrency: int = 4
    contract_check: bool = True
    progress: bool = True
    layout: Any = None  # a slime_ascend.parallel_layout.Layout, in slime's loop only (the actor's and the critic's)


def available_plugins(requested: tuple[str, ...]) -> tuple[tuple[str, ...], list[str]]:
    """The requested plugins that load here; the others (e.g. a sync plugin not installed yet) with why."""
    from slime_ascend.plugins import registry

    known, broken = registry.available(), registry.broken()
    keep, notes = [], []
    for name in requested:
        if name in known:
            keep.append(name)
        elif name in SYNC_PLUGINS and name in broken:
            notes.append(f"plugin {name!r} is not loadable here ({broken[name]}); the demo calls the "
                         "slime_ascend.quant function it wraps directly")
        else:
            registry.resolve_selection([name])  # raises the registry's explanatory error
    return tuple(keep), notes


def task_settings(plugin: str, cfg: DemoConfig, paths: dict[str, str], teacher_url: str) -> dict[str, Any]:
    """The YAML values both loops give ``plugin`` for the demo's task (the environment, the teachers, ...)."""
    if plugin == "compaction":
        return dict(ascend_compaction_env="slime_ascend.demo.task.DigitsEnv", ascend_compaction_env_kwargs={},
                    ascend_compaction_context_budget=cfg.context_budget,
                    ascend_compaction_trigger_tokens=cfg.trigger_tokens, ascend_compaction_keep_pairs=1,
                    ascend_compaction_max_compactions=2, ascend_compaction_summary_max_tokens=4,
                    ascend_compaction_use_chat_template=False,
                    # the opd reward model must run on every segment: slime skips the RM when generate
                    # already set a reward, so the environment's reward goes through the task RM instead
                    ascend_compaction_env_reward=False,
                    ascend_compaction_summary_prompt_path=paths["summary_prompt"],
                    ascend_compaction_resume_template_path=paths["resume_template"])
    if plugin == "opd":
        return dict(ascend_opd_teachers=[{"name": "copy", "checkpoint_dir": paths["copy"], "domains": ["copy"]},
                                         {"name": "next", "checkpoint_dir": paths["next"], "domains": ["next"]}],
                    ascend_opd_switch_engine_urls=[teacher_url],
                    ascend_opd_task_rm_path="slime_ascend.demo.task.task_reward",
                    ascend_opd_stage_dir=paths["teacher_stage"], ascend_opd_prefetch=True,
                    ascend_opd_coef=cfg.opd_coef, ascend_opd_clip=cfg.opd_clip)
    if plugin == "staleness":
        return dict(ascend_staleness_tau=cfg.staleness_tau)
    return {}


def write_yaml(plugins: tuple[str, ...], edits: dict[str, Any], path: str | Path,
               slime_args: dict[str, Any] | None = None) -> Any:
    """``slime-ascend config <plugins>``'s YAML with the demo's ``edits`` at ``path``; returns the generated config.

    ``slime_args``: plain slime arguments added at the end, as a user appends them to the file (slime's
    ``--custom-config-path`` sets them after the command line and after slime's own rules, e.g. its
    ``bf16 = not fp16``); unlike ``edits`` they need not be keys of the generated YAML."""
    import yaml

    from slime_ascend import config as ascend_config

    generated = ascend_config.build(list(plugins))
    values = yaml.safe_load(generated.yaml_text)
    unknown = [k for k in edits if k not in values]
    if unknown:
        raise RuntimeError(f"the demo sets keys the generated YAML does not have: {unknown}")
    values.update(edits)
    values.update(slime_args or {})
    Path(path).write_text(yaml.safe_dump(values, sort_keys=False))
    return generated


def build_args(cfg: DemoConfig, plugins: tuple[str, ...], paths: dict[str, str], urls: dict[str, str]
               ) -> argparse.Namespace:
    """slime-shaped args: slime defaults for the flags the hooks read, then the plugins' YAML on top."""
    import yaml

    from slime_ascend.rollout.torch_engine.model import TINY_QWEN3_KWARGS

    host, port = urls["engine"].removeprefix("http://").rsplit(":", 1)
    args = argparse.Namespace(
        # the command line slime needs for these plugins (printed by `slime-ascend config`)
        advantage_estimator="ppo", n_samples_per_prompt=1, megatron_config_path=paths["megatron_config"],
        rollout_batch_size=cfg.batch, global_batch_size=cfg.batch, num_rollout=cfg.steps,
        hf_checkpoint=paths["policy"], vocab_size=TINY_QWEN3_KWARGS["vocab_size"], seed=cfg.seed,
        sglang_router_ip=host, sglang_router_port=int(port), rollout_temperature=1.0,
        rollout_max_response_len=cfg.max_new_tokens, rollout_max_context_len=cfg.context_budget,
        # slime defaults of what the hooks and loss read
        kl_coef=0.0, gamma=1.0, lambd=1.0, eps_clip=0.2, eps_clip_high=None, value_clip=0.2, reward_key=None,
        rewards_normalization=False, normalize_advantages=False, use_kl_loss=False, entropy_coef=0.0,
        use_tis=False, use_opd=False, opd_type="sglang", opd_kl_coef=0.0, opd_teacher_load=None,
        custom_advantage_function_path=None, custom_loss_function_path=None, loss_type="policy_loss",
        calculate_per_token_loss=False, use_rollout_logprobs=False, log_probs_chunk_size=-1, allgather_cp=False,
        group_rm=False, partial_rollout=False, use_critic=True, freeze_params_name_list=None,
    )
    # the demo's edits of the generated YAML (what a user edits before launching); sao is always enabled (run_demo)
    edits: dict[str, Any] = {k: v for p in plugins for k, v in task_settings(p, cfg, paths, urls["teacher"]).items()}
    edits.update(ascend_sao_freeze_patterns=["self_attn"], ascend_sao_dis_preset="maths")
    # the miniature's engine starts on the BF16 policy and takes the quantised format from the first sync on
    # (slime's loop quantises the engine's checkpoint offline instead, as a user does): no format to check
    edits.update({f"ascend_{p.replace('-', '_')}_check_engine_format": False for p in plugins if p in SYNC_PLUGINS})
    write_yaml(plugins, edits, paths["yaml"])
    for key, value in yaml.safe_load(Path(paths["yaml"]).read_text()).items():  # slime's --custom-config-path
        setattr(args, key, value)
    return args


def _episodes(cfg: DemoConfig, step: int) -> list[dict[str, Any]]:
    from slime_ascend.demo.task import make_episodes

    rng = random.Random(cfg.seed * 7919 + step)
    tasks = [e.to_task() for e in make_episodes(rng, cfg.batch, cfg.long_fraction, cfg.fillers)]
    # ordered by teacher (domain), so the shared teacher engine switches about once per step
    return sorted(tasks, key=lambda t: str(t.get("domain", "")))


def prepare_task(cfg: DemoConfig, out: Path) -> tuple[dict[str, str], dict[str, dict[str, float]], float]:
    """What both loops start from: the paths of the checkpoints (``policy``, ``copy``, ``next``), of the
    compaction prompt files and of ``teacher_stage``; the checkpoints' p(right answer); the seconds they took."""
    from slime_ascend.demo.task import (
        GLM5_SFT,
        RESUME_TEMPLATE,
        SUMMARY_PROMPT,
        checkpoint_answer_probs,
        prepare_checkpoints,
    )

    t0 = time.perf_counter()
    glm5 = cfg.model == "glm5"
    ckpt = prepare_checkpoints(out / "checkpoints", cfg.seed, glm5=glm5, **(GLM5_SFT if glm5 else {}))
    start = checkpoint_answer_probs(ckpt)
    seconds = time.perf_counter() - t0
    (out / "prompts").mkdir(parents=True, exist_ok=True)
    summary, resume = out / "prompts" / "summary_prompt.txt", out / "prompts" / "resume_template.txt"
    summary.write_text(SUMMARY_PROMPT)
    resume.write_text(RESUME_TEMPLATE)
    paths = dict(ckpt, teacher_stage=str(out / "teacher_stage"), summary_prompt=str(summary),
                 resume_template=str(resume))
    return paths, start, seconds


def _verifier_gate(args: argparse.Namespace, plugins: tuple[str, ...]) -> str:
    """The ``verifier-gate`` plugin's checks on the verifiers this run trains with, as slime's ``parse_args`` runs
    them (a verifier that fails is refused in one line: the run stops before its first rollout)."""
    from slime_ascend.verifiers.job import gate

    checked = gate(args, [*plugins, "verifier-gate"])
    return "; ".join(f"{v.kind} {v.name} passed oracle, no_action and unfinished ({len(results)} runs)"
                     for v, results in checked) or "no verifier in this run"


def _step_line(step: int, steps: int, m: dict[str, Any]) -> str:
    def f(key: str, fmt: str = "{:.3f}") -> str:
        v = m.get(key)
        return "-" if v is None else fmt.format(v)

    return (f"step {step + 1:>3}/{steps} | reward {f('reward')} | kl {f('kl')} | masked {f('masked_frac')} | "
            f"stale drops {f('staleness_drops', '{:d}')} | teacher switches {f('teacher_switches', '{:d}')} | "
            f"sync {f('sync_gbps', '{:.3f}')} GB/s v{f('version', '{:d}')} | compactions {f('compactions', '{:d}')}")


def run_demo(cfg: DemoConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the closed loop; returns the summary (also written to ``<out>/summary.json``)."""
    if cfg.model != "qwen3":
        raise ValueError(f"the miniature loop trains the tiny Qwen3 only; --model {cfg.model} runs in slime's own "
                         "loop (--slime-src)")
    t_start = time.perf_counter()
    out = Path(cfg.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    plugins, notes = available_plugins(tuple(cfg.plugins))
    if "sao" not in plugins:
        raise ValueError("the demo trains with the loss hook of an enabled plugin: include 'sao' in --plugins "
                         "(it provides the policy/value loss and the critic's advantage path)")
    for note in notes:
        log(f"note: {note}")
    # this process plays slime's driver: the plugins it runs must match the YAML (restored at the end)
    previous_env = os.environ.get("SLIME_ASCEND_PLUGINS")
    os.environ["SLIME_ASCEND_PLUGINS"] = ",".join(plugins)
    try:
        return _run(cfg, log, out, plugins, notes, t_start)
    except OSError as exc:  # a full disk under --out: the one line names the directory (the writer may not)
        if exc.filename is not None or exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
            raise
        raise OSError(exc.errno, f"{exc.strerror} (writing the demo's files under --out)", str(out)) from None
    finally:
        if previous_env is None:
            os.environ.pop("SLIME_ASCEND_PLUGINS", None)
        else:
            os.environ["SLIME_ASCEND_PLUGINS"] = previous_env


def _run(cfg: DemoConfig, log, out: Path, plugins: tuple[str, ...], notes: list[str], t_start: float
         ) -> dict[str, Any]:
    import ray

    from slime_ascend.demo.rollout import RolloutWorker
    from slime_ascend.demo.trainer import Trainer
    from slime_ascend.sao.role_config import write_megatron_role_config

    log(f"slime-ascend demo: plugins {', '.join(plugins)}; seed {cfg.seed}; {cfg.steps} steps; output {out}")
    paths, start, seconds = prepare_task(cfg, out)
    levels = ", ".join(("policy" if name == "policy" else f"teacher {name}") + " ("
                       + ", ".join(f"{dom} {p:.2f}" for dom, p in probs.items()) + ")" for name, probs in start.items())
    log(f"prepared the initial policy and two teachers in {seconds:.1f}s; p(right answer): {levels}")
    paths["yaml"] = str(out / "ascend.yaml")
    paths["megatron_config"] = str(out / "sao_megatron.yaml")  # sao's critic role config (sao is always enabled)
    write_megatron_role_config(paths["megatron_config"], ["self_attn"], force=True)
    metrics_path = out / "metrics.jsonl"
    metrics_path.write_text("")
    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {"plugins": list(plugins), "seed": cfg.seed, "steps_requested": cfg.steps,
                               "notes": notes, "interrupted": False, "start_answer_probs": start}
    env = {"SLIME_ASCEND_PLUGINS": ",".join(plugins), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1"}
    bar = None
    try:
        t0 = time.perf_counter()
        ray.init(num_cpus=cfg.num_cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 runtime_env={"env_vars": env}, configure_logging=False)
        log(f"ray: local cluster with {cfg.num_cpus} CPUs in {time.perf_counter() - t0:.1f}s")
        rollout = ray.remote(num_cpus=1)(RolloutWorker).remote(paths["policy"], paths["copy"], cfg.seed)
        urls = ray.get(rollout.urls.remote())
        args = build_args(cfg, plugins, paths, urls)
        summary["verifier_gate"] = _verifier_gate(args, plugins)
        log(f"verifier gate: {summary['verifier_gate']}")
        sampling = {"temperature": 1.0, "max_new_tokens": cfg.max_new_tokens}
        trainer = ray.remote(num_cpus=1)(Trainer).remote(
            args, paths["policy"], str(out), lr=cfg.lr, critic_lr=cfg.critic_lr, seed=cfg.seed,
            lr_warmup_steps=cfg.lr_warmup_steps,
            sync_format=next((SYNC_PLUGINS[p] for p in cfg.plugins if p in SYNC_PLUGINS), None))
        ray.get(rollout.set_args.remote(args, sampling, cfg.concurrency, cfg.late_long_episodes))
        log(f"engines: rollout {urls['engine']}, teachers {urls['teacher']}; actors ready in "
            f"{time.perf_counter() - t0:.1f}s")
        if cfg.progress and sys.stderr.isatty():  # a bar only on a terminal; a log gets one line per step
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, desc="demo", unit="step", file=sys.stderr, dynamic_ncols=True)
        pending = rollout.generate.remote(0, _episodes(cfg, 0))
        for step in range(cfg.steps):
            data, rm = ray.get(pending)
            if cfg.overlap and step + 1 < cfg.steps:  # train_async: the next rollout overlaps this training step
                pending = rollout.generate.remote(step + 1, _episodes(cfg, step + 1))
            tm = ray.get(trainer.train.remote(step, data))
            sync = ray.get(rollout.update_weights.remote(tm["weights_dir"], tm["version"]))
            if not cfg.overlap and step + 1 < cfg.steps:  # train.py: generate with the weights just synced
                pending = rollout.generate.remote(step + 1, _episodes(cfg, step + 1))
            m = _merge(step, rm, tm, sync)
            history.append(m)
            with metrics_path.open("a") as f:
                f.write(json.dumps(m) + "\n")
            line = _step_line(step, cfg.steps, m)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{m['reward']:.2f}")
                bar.write(line)
            else:
                log(line)
        final_dir = ray.get(trainer.save_final.remote(str(out / "checkpoints" / "policy_final")))
        summary["final_policy"] = final_dir
    except KeyboardInterrupt:
        summary["interrupted"] = True
        log("interrupted: shutting Ray down; metrics written so far are kept")
    finally:
        if bar is not None:
            bar.close()
        ray.shutdown()
    summary.update(_summarise(history))
    summary["plugin_lines"] = plugin_summary_lines(history, plugins)
    if history:
        from slime_ascend.demo.plots import plot_curves

        summary["plot"] = plot_curves(history, str(out / "curves.png"),
                                      title=f"slime-ascend demo (miniature loop): {', '.join(plugins)}; seed {cfg.seed}")
    if cfg.contract_check and not summary["interrupted"]:
        from slime_ascend.contracts.check import format_table, run_check

        report = run_check(None, seed=cfg.seed, out_json=str(out / "contracts.json"),
                           topk_shape=(4, 2048, 128))
        summary["contracts_passed"] = report.passed
        table = format_table(report)
        (out / "contracts.txt").write_text(table + "\n")
        log("\ncontract report (slime-ascend check, this device):\n" + table)
    summary["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    log(_summary_text(summary, out))
    return summary


def _merge(step: int, rm: dict[str, Any], tm: dict[str, Any], sync: dict[str, Any]) -> dict[str, Any]:
    m: dict[str, Any] = {"step": step, **rm, **{k: v for k, v in tm.items() if k != "weights_dir"}, **sync}
    seconds = tm.get("sync_export_s", 0.0) + sync.get("engine_load_s", 0.0)
    m["sync_gbps"] = tm.get("sync_bytes", 0) / max(seconds, 1e-9) / 1e9
    m["kl"] = rm.get("opd_kl")
    m["masked_frac"] = tm.get("actor/dis_masked_frac")
    m["mismatch"] = tm.get("actor/train_rollout_logprob_abs_diff")
    return m


def _summarise(history: list[dict[str, Any]]) -> dict[str, Any]:
    if not history:
        return {"steps_done": 0}
    rewards = [h["reward"] for h in history]
    k = max(1, min(5, len(rewards) // 3))
    return {
        "steps_done": len(history),
        "reward_first": sum(rewards[:k]) / k,
        "reward_last": sum(rewards[-k:]) / k,
        "teacher_switches": history[-1].get("teacher_switches"),
        "sync_versions": [h.get("engine_version") for h in history],
        "compactions": sum(h.get("compactions", 0) for h in history),
        "staleness_drops": sum(h.get("staleness_drops", 0) for h in history),
        "sync_gbps_median": sorted(h["sync_gbps"] for h in history)[len(history) // 2],
        "sync_bytes_ratio": history[-1].get("sync_bytes", 0) / max(1, history[-1].get("sync_unquantised_bytes", 1)),
    }


def plugin_summary_lines(history: list[dict[str, Any]], plugins: tuple[str, ...] | list[str]) -> dict[str, str]:
    """One line per enabled plugin: what the run's metrics show it did (first -> last step where it moves)."""
    def series(key: str) -> list[float]:
        return [h[key] for h in history if isinstance(h.get(key), int | float)]

    def first_last(key: str, fmt: str = "{:.3f}") -> str:
        values = series(key)
        return f"{fmt.format(values[0])} -> {fmt.format(values[-1])}" if values else "not logged"

    def mean(key: str) -> float:
        values = series(key)
        return sum(values) / len(values) if values else 0.0

    last = history[-1] if history else {}
    lines: dict[str, str] = {}
    for plugin in plugins:
        if not history:
            lines[plugin] = "no step finished"
        elif plugin == "sao":
            lines[plugin] = (f"critic value loss {first_last('critic/value_loss')}, DIS masked {mean('masked_frac'):.3f} "
                             f"of trained tokens on average (max {max(series('masked_frac'), default=0.0):.3f})")
        elif plugin == "compaction":
            lines[plugin] = (f"{sum(series('compactions')):.0f} compactions, up to "
                             f"{max(series('segments_max'), default=0):.0f} segments in one episode")
        elif plugin == "opd":
            routed: dict[str, int] = {}
            for h in history:
                for teacher, n in (h.get("teacher_routing") or {}).items():
                    routed[teacher] = routed.get(teacher, 0) + int(n)
            lines[plugin] = (f"{len(routed)} teachers ({', '.join(f'{t} {n}' for t, n in sorted(routed.items()))} "
                             f"samples), {last.get('teacher_switches', 0)} switches, {last.get('teacher_prefetch_hits') or 0} "
                             f"prefetch hits, KL to the routed teacher {first_last('kl', '{:.2f}')}")
        elif plugin == "staleness":
            report = last.get("staleness_report") or {}
            lag = max((h.get("staleness_report") or {}).get("max_lag", 0) for h in history)
            lines[plugin] = (f"tau {report.get('tau', '?')}: {sum(series('staleness_drops')):.0f} rollouts dropped, "
                             f"max weight-version lag {lag}")
        elif plugin.endswith("-sync"):
            lines[plugin] = (f"{len(history)} versions pushed (engine at v{last.get('engine_version')}), "
                             f"{last.get('sync_bytes', 0) / max(1, last.get('sync_unquantised_bytes', 1)):.2f}x the "
                             f"fp32 bytes, train/rollout log-prob gap {first_last('mismatch', '{:.4f}')}")
        elif plugin in ("dis", "icepop"):
            lines[plugin] = f"masked {mean('masked_frac'):.3f} of trained tokens on average"
        else:
            lines[plugin] = "enabled; the miniature loop logs no metric of its own for it"
    return lines


def _summary_text(s: dict[str, Any], out: Path) -> str:
    if not s.get("steps_done"):
        return f"no step finished; outputs in {out}"
    evidence = "".join(f"\n  {plugin}: {line}" for plugin, line in s.get("plugin_lines", {}).items())
    return (f"\nwhat each plugin showed:{evidence}"
            f"\nreward {s['reward_first']:.3f} -> {s['reward_last']:.3f} over {s['steps_done']} steps; "
            f"teacher switches {s['teacher_switches']}; compactions {s['compactions']}; staleness drops "
            f"{s['staleness_drops']}; synced versions up to {s['sync_versions'][-1]} "
            f"({s['sync_bytes_ratio']:.2f}x the unquantised fp32 bytes, median {s['sync_gbps_median']:.3f} GB/s)\n"
            f"wrote {out / 'metrics.jsonl'}, {out / 'summary.json'}, {out / 'curves.png'} "
            f"in {s.get('elapsed_s', '?')}s")

"""A CPU stand-in for the Ascend cluster a recipe in ``examples/`` is written for.

The recipe's ``run.sh`` runs as written (``bash run.sh``: its ``set -euo pipefail``, its Ray guard, its
``slime-ascend quantize`` / ``python -m slime_ascend.sao.critic`` steps, its flags and its YAML), with
three things standing in for what this host lacks:

* ``ray`` is this script (a ``ray`` executable on PATH runs it): ``ray status`` says no cluster runs
  (unless ``STANDIN_RAY_RUNNING=1``), ``ray start``/``ray stop`` do nothing, and ``ray job submit ... --
  python3 $SLIME_DIR/<script>.py FLAGS`` runs real slime's ``<script>.py`` (``SLIME_SRC``) on this host
  with the flags rewritten by :func:`rewrite_flags` and the YAML by :func:`rewrite_config`;
* ``$SLIME_DIR`` holds only ``scripts/models/*.sh``, each defining a tiny model's ``MODEL_ARGS``;
* ``$BASE`` holds the recipe's checkpoints and data as the tiny models and a few prompts.

What changes for the host, and nothing else: ``npu`` runs as ``cpu,npu`` (npu on the host: the npu
plugin's own code with the cpu accelerator's device operations), ``sglang-npu`` gives way to
``torch-engine`` (slime's own engine actors start the package's torch engine in place of SGLang's server;
slime's placement, ``--colocate`` offload/onload and weight transport are its own), the device counts and
parallel sizes are capped at what one host with ``NUM_NPUS`` devices holds (:func:`host_layout`), and the
sizes are one small rollout. What was rewritten is recorded in ``$STANDIN_WORK/standin.json`` (the recipe's
flags and plugins, and slime's) for the test to check against its list.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

# the plugins that need what this host lacks, and what runs in their place
PLUGIN_STANDINS = {"npu": ("cpu", "npu"), "sglang-npu": ("torch-engine",)}
ROLLOUT_BATCH, MAX_SAMPLES, MAX_RESPONSE = 2, 2, 8
# the most train ranks one job role runs with on this 2-core host (TP 2, or EP 2)
MAX_RANKS = 2


def _takes_value(argv: list[str], i: int) -> bool:
    return i + 1 < len(argv) and not argv[i + 1].startswith("--")


def _values(argv: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        has_value = _takes_value(argv, i)
        out[argv[i]] = argv[i + 1] if has_value else None
        i += 2 if has_value else 1
    return out


def host_layout(values: dict[str, str | None]) -> dict[str, str]:
    """The recipe's device counts and parallel sizes capped at one host: one node; tensor and expert
    parallelism at most the actor's devices (and :data:`MAX_RANKS`); an engine at most the devices slime
    gives the engines (the actor's under ``--colocate``, else ``--rollout-num-gpus``). Only what changes."""
    out: dict[str, str] = {}
    if values.get("--actor-num-nodes") not in (None, "1"):
        out["--actor-num-nodes"] = "1"
    devices = int(values.get("--actor-num-gpus-per-node") or 1)
    for flag in ("--tensor-model-parallel-size", "--expert-model-parallel-size"):
        if values.get(flag) is not None and int(values[flag]) > min(devices, MAX_RANKS):
            out[flag] = str(min(devices, MAX_RANKS))
    engine_devices = devices if "--colocate" in values else int(values.get("--rollout-num-gpus") or devices)
    per_engine = values.get("--rollout-num-gpus-per-engine")
    if per_engine is not None and int(per_engine) > engine_devices:
        out["--rollout-num-gpus-per-engine"] = str(engine_devices)
    return out


def rewrite_flags(argv: list[str], config: Path | None, cpu_flags: list[str]) -> list[str]:
    """The recipe's slime flags for this host: the sizes of one small rollout, :func:`host_layout`, the
    stand-in YAML, and the cpu plugin's Megatron flags (``cpu_flags``). Every other flag as written."""
    values = _values(argv)
    layout = host_layout(values)
    n = min(int(values.get("--n-samples-per-prompt") or 1), MAX_SAMPLES)
    sizes = {"--num-rollout": "1", "--rollout-batch-size": str(ROLLOUT_BATCH), "--n-samples-per-prompt": str(n),
             "--rollout-max-response-len": str(MAX_RESPONSE), "--global-batch-size": str(ROLLOUT_BATCH * n)}
    out: list[str] = []
    i = 0
    while i < len(argv):
        flag = argv[i]
        has_value = _takes_value(argv, i)
        value = argv[i + 1] if has_value else None
        i += 2 if has_value else 1
        if flag in layout:
            value = layout[flag]
        elif flag in sizes:
            value = sizes[flag]
        elif flag == "--custom-config-path" and config is not None:
            value = str(config)
        out += [flag] + ([value] if value is not None else [])
    return out + cpu_flags


def _config_of(*plugins: str) -> dict:
    """The settings ``slime-ascend config PLUGIN...`` writes (in this process: a CLI run per call costs a torch
    import)."""
    import yaml

    from slime_ascend import config

    cfg = yaml.safe_load(config.build(list(plugins)).yaml_text)
    cfg.pop("ascend_plugins", None)
    return cfg


def standin_plugins(plugins: list[str]) -> list[str]:
    out: list[str] = []
    for p in plugins:
        for q in PLUGIN_STANDINS.get(p, (p,)):
            if q not in out:
                out.append(q)
    return out


def rewrite_config(src: Path, dst: Path, plugins: list[str], base: Path, start) -> list:
    """The recipe's YAML for this host: the stand-in plugins, their settings (defaults) in place of the replaced
    plugins' (sglang-npu's), and OPD teachers served by torch engines (``start(model_dir)`` starts one and
    returns it). Returns the engines it started."""
    import yaml

    cfg = yaml.safe_load(src.read_text())
    recipe_plugins = list(cfg["ascend_plugins"])
    for p in recipe_plugins:
        if p in PLUGIN_STANDINS and p not in plugins:  # npu still runs (on the host)
            for key in _config_of(p):
                cfg.pop(key, None)
    cfg["ascend_plugins"] = plugins
    for p in plugins:
        if p not in recipe_plugins:
            for key, value in _config_of(p).items():
                cfg.setdefault(key, value)
    engines = []
    for teacher in cfg.get("ascend_opd_teachers") or []:
        teacher["checkpoint_dir"] = str(base / "teachers" / teacher["name"])
        if teacher.get("url"):
            engines.append(start(Path(teacher["checkpoint_dir"])))
            teacher["url"] = engines[-1].url
    if cfg.get("ascend_opd_switch_engine_urls"):
        switch = [start(base / "teachers" / "switch-engine-start") for _ in cfg["ascend_opd_switch_engine_urls"]]
        cfg["ascend_opd_switch_engine_urls"] = [e.url for e in switch]
        engines += switch
    dst.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return engines


def submit(argv: list[str]) -> int:
    """``ray job submit [--address A] [--runtime-env-json J] -- python3 $SLIME_DIR/<script>.py FLAGS``."""
    from slime_ascend.demo.slime_job import (
        job_env,
        plugin_flags,
        slime_src,
        start_engine,
        stop,
    )

    sep = argv.index("--")
    opts, cmd = argv[:sep], argv[sep + 1:]
    runtime_env = {}
    for i, opt in enumerate(opts):  # --runtime-env-json J or --runtime-env-json=J (what the recipes write)
        if opt == "--runtime-env-json":
            runtime_env = json.loads(opts[i + 1])
        elif opt.startswith("--runtime-env-json="):
            runtime_env = json.loads(opt.split("=", 1)[1])
    env_vars = dict(runtime_env.get("env_vars", {}))
    recipe_plugins = env_vars.pop("SLIME_ASCEND_PLUGINS", os.environ["SLIME_ASCEND_PLUGINS"]).split(",")
    env_vars.pop("PYTHONPATH", None)  # the recipe's Megatron-LM checkout: job_env puts slime's tree and this package
    plugins = standin_plugins(recipe_plugins)
    script, flags = Path(cmd[1]).name, cmd[2:]
    work = Path(os.environ["STANDIN_WORK"])
    base = Path(os.environ["BASE"])
    started: list = []

    def start(model_dir: Path):
        return start_engine(model_dir, work / f"engine-{len(started)}.log")

    try:
        config = None
        if "--custom-config-path" in flags:
            config = work / "ascend.standin.yaml"
            started += rewrite_config(Path(flags[flags.index("--custom-config-path") + 1]), config, plugins, base,
                                      start)
        full = [sys.executable, str(slime_src() / script), *rewrite_flags(flags, config, plugin_flags(("cpu",)))]
        (work / "standin.json").write_text(json.dumps({
            "script": script, "recipe_flags": flags, "flags": full[2:], "recipe_plugins": recipe_plugins,
            "plugins": plugins}))
        print("stand-in: " + shlex.join(full), flush=True)
        env = job_env(tuple(plugins), env_vars)
        return subprocess.run(full, env=env, cwd=str(work), check=False).returncode
    finally:
        for eng in started:
            stop(eng.proc)


def main(argv: list[str]) -> int:
    if argv[:1] == ["status"]:
        if os.environ.get("STANDIN_RAY_RUNNING") == "1":
            print("======== Autoscaler status (stand-in) ========")
            return 0
        print("No cluster running (stand-in)", file=sys.stderr)
        return 1
    if argv[:1] in (["start"], ["stop"]):
        print(f"stand-in: ray {shlex.join(argv)}")
        return 0
    if argv[:2] == ["job", "submit"]:
        return submit(argv[2:])
    print(f"stand-in ray: unsupported command {shlex.join(argv)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A CPU stand-in for the Ascend cluster a recipe in ``examples/`` is written for.

The recipe's ``run.sh`` runs as written (``bash run.sh``: its ``set -euo pipefail``, its Ray guard, its
``slime-ascend quantize`` / ``python -m slime_ascend.sao.critic`` steps, its flags and its YAML), with
three things standing in for what this host lacks:

* ``ray`` is this script (a ``ray`` executable on PATH runs it): ``ray status`` says no cluster runs
  (unless ``STANDIN_RAY_RUNNING=1``), ``ray start``/``ray stop`` do nothing, and ``ray job submit ... --
  python3 $SLIME_DIR/<script>.py FLAGS`` runs real slime's ``<script>.py`` (``SLIME_SRC``) on this host
  with the flags rewritten by :func:`rewrite_flags` and the YAML by :func:`rewrite_config`;
* ``$SLIME_DIR`` holds only ``scripts/models/*.sh``, each defining the tiny Qwen3's ``MODEL_ARGS``;
* ``$BASE`` holds the recipe's checkpoints and data as the tiny model and a few prompts.

What changes for the host, and nothing else: ``npu`` runs as ``cpu,npu`` (npu on the host: the npu
plugin's own code with the cpu accelerator's device operations), ``sglang-npu`` gives way to the
package's torch engine (SGLang's HTTP surface; slime reaches it as an external engine, and weights
travel by disk), every device count and parallel size is 1, and the sizes are one small rollout.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

# the plugins that need what this host lacks, and what runs in their place
PLUGIN_STANDINS = {"npu": ("cpu", "npu"), "sglang-npu": ()}
ONE = ("--actor-num-nodes", "--actor-num-gpus-per-node", "--rollout-num-gpus", "--rollout-num-gpus-per-engine",
       "--critic-num-nodes", "--critic-num-gpus-per-node", "--tensor-model-parallel-size",
       "--pipeline-model-parallel-size", "--context-parallel-size", "--expert-model-parallel-size",
       "--expert-tensor-parallel-size")
# --sequence-parallel needs tensor parallelism; --colocate shares accelerator memory between the train actors
# and engines slime starts, and the stand-in's engine is an external one (slime asks an external engine
# for SGLang's memory saver when colocated)
DROPPED_SWITCHES = ("--sequence-parallel", "--colocate")
DROPPED_WITH_VALUE = ("--sglang-mem-fraction-static",)  # an SGLang engine option; the torch engine has none
ROLLOUT_BATCH, MAX_SAMPLES, MAX_RESPONSE = 2, 2, 8


def _takes_value(argv: list[str], i: int) -> bool:
    return i + 1 < len(argv) and not argv[i + 1].startswith("--")


def rewrite_flags(argv: list[str], engine_addrs: list[str], disk: Path, config: Path | None) -> list[str]:
    """The recipe's slime flags for this host: sizes of one small rollout, every count and parallel size 1,
    the external torch engine(s) and disk weight transport, the cpu plugin's Megatron flags."""
    out: list[str] = []
    values: dict[str, str] = {}
    i = 0
    while i < len(argv):
        flag = argv[i]
        has_value = _takes_value(argv, i)
        value = argv[i + 1] if has_value else None
        i += 2 if has_value else 1
        if flag in DROPPED_SWITCHES or flag in DROPPED_WITH_VALUE:
            continue
        if flag in ONE:
            value = "1"
        elif flag == "--num-rollout":
            value = "1"
        elif flag == "--rollout-batch-size":
            value = str(ROLLOUT_BATCH)
        elif flag == "--n-samples-per-prompt":
            value = str(min(int(value), MAX_SAMPLES))
        elif flag == "--rollout-max-response-len":
            value = str(MAX_RESPONSE)
        elif flag == "--custom-config-path" and config is not None:
            value = str(config)
        values[flag] = value
        out += [flag] + ([value] if value is not None else [])
    n = int(values.get("--n-samples-per-prompt") or 1)
    if "--global-batch-size" in values:
        out[out.index("--global-batch-size") + 1] = str(ROLLOUT_BATCH * n)
    added = ["--rollout-external", "--rollout-external-engine-addrs", *engine_addrs,
             "--update-weight-mode", "full", "--update-weight-transport", "disk", "--update-weight-disk-dir", str(disk)]
    for flag, value in (("--seq-length", "256"), ("--max-position-embeddings", "4096"), ("--bf16", None),
                        ("--seed", "1234")):
        if flag not in values:
            added += [flag] + ([value] if value else [])
    if "--rollout-num-gpus" not in values:  # a colocated recipe's engines shared the train actors' devices
        added += ["--rollout-num-gpus", "1"]
    if "--use-dynamic-batch-size" not in values and "--micro-batch-size" not in values:
        added += ["--micro-batch-size", "1"]
    return out + added + _cpu_flags()


def _cpu_flags() -> list[str]:
    out = subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", "cpu", "--flags"],
                         capture_output=True, text=True, check=True).stdout
    return shlex.split(out)


def _config_of(*plugins: str) -> dict:
    import yaml

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yaml"
        subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", *plugins, "-o", str(path)],
                       capture_output=True, text=True, check=True)
        cfg = yaml.safe_load(path.read_text())
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
    """The recipe's YAML for this host: the stand-in plugins, the cpu plugin's settings, no sglang-npu
    settings, and OPD teachers served by torch engines (``start(model_dir)`` starts one and returns
    it). Returns the engines it started."""
    import yaml

    cfg = yaml.safe_load(src.read_text())
    dropped = [p for p in cfg["ascend_plugins"] if p in PLUGIN_STANDINS]
    for p in dropped:
        if p not in ("npu",):  # npu still runs (on the host); its stand-in plugins' settings are added below
            for key in _config_of(p):
                cfg.pop(key, None)
    cfg["ascend_plugins"] = plugins
    for key, value in _config_of("cpu").items():
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
    from slime_ascend.demo.slime_job import job_env, slime_src, start_engine, stop

    sep = argv.index("--")
    opts, cmd = argv[:sep], argv[sep + 1:]
    runtime_env = {}
    if "--runtime-env-json" in opts:
        runtime_env = json.loads(opts[opts.index("--runtime-env-json") + 1])
    env_vars = {k: v for k, v in runtime_env.get("env_vars", {}).items() if k != "PYTHONPATH"}
    plugins = standin_plugins(env_vars.get("SLIME_ASCEND_PLUGINS", os.environ["SLIME_ASCEND_PLUGINS"]).split(","))
    script, flags = Path(cmd[1]).name, cmd[2:]
    work = Path(os.environ["STANDIN_WORK"])
    base = Path(os.environ["BASE"])
    engines: list = []
    started: list = []

    def start(model_dir: Path):
        return start_engine(model_dir, work / f"engine-{len(engines) + len(started)}.log")

    try:
        config = None
        if "--custom-config-path" in flags:
            config = work / "ascend.standin.yaml"
            started += rewrite_config(Path(flags[flags.index("--custom-config-path") + 1]), config, plugins, base,
                                      start)
        rollout = start(Path(flags[flags.index("--hf-checkpoint") + 1]))
        engines.append(rollout)
        disk = work / "weights"
        disk.mkdir(exist_ok=True)
        full = [sys.executable, str(slime_src() / script), *rewrite_flags(flags, [rollout.addr], disk, config)]
        print("stand-in: " + shlex.join(full), flush=True)
        env = job_env(tuple(plugins), env_vars)
        return subprocess.run(full, env=env, cwd=str(work)).returncode
    finally:
        for eng in engines + started:
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

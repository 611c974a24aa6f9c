"""``slime-ascend dryrun -- <slime launch command>``: what would fail on the Ascend cluster, before booking NPU time.

It takes the user's exact launch command (``python train.py ...``, ``ray job submit ... -- python3 train.py ...``,
or slime's flags alone; leading ``VAR=value`` words and ``--runtime-env-json``'s ``env_vars`` are the job's
environment, on top of this shell's) and the plugins (``--plugins``, else ``SLIME_ASCEND_PLUGINS`` of the job), and
reports one line per problem; exit status 0 when there is none, 1 otherwise. It starts no Ray cluster and touches no
device. What it checks:

* **plugins**: set, known and loadable, together; ``npu`` among them, ``cpu`` not (``cpu,npu`` is the host's mode);
* **flags**: slime's own ``parse_args`` on the command in a subprocess with those plugins activated (the job's
  YAML, ``--custom-config-path``, applied as slime applies it), then every plugin's start-up validation
  (:func:`slime_ascend.plugins.runtime.check`: settings, flags slime needs, each plugin's checks), as the driver
  runs them at ``parse_args`` on the cluster; a bad flag is slime's own argparse or assertion line;
* **offload and environment** (:mod:`slime_ascend.accelerator.launch`): train offload that torch_memory_saver's
  NPU build cannot do, ``--colocate`` without ``--release-train``, both allocator variables; and the HCCL port
  ranges the engines and the train actors would disagree on (``sglang_npu.hccl_problem``), each reported even
  when an earlier one would stop the driver first;
* **placement**: the NPUs slime's placement group asks Ray for (slime's own layout rule) against the cluster
  declared by ``--nodes`` / ``--npus-per-node`` (default: the command's ``--actor-num-nodes`` nodes of
  ``--num-gpus-per-node`` NPUs, or ``RAY_OVERRIDE_RESOURCES``' ``NPU``), train actors and engines per node; and on
  an Ascend node, whether ``ray start`` here would see every NPU (pyACL importable, else ``/dev/davinci?``).

slime's ``parse_args`` reads the model's ``config.json`` from ``--hf-checkpoint``: where that path is not on this
host, ``--hf-config DIR`` stands in for it (a directory with the model's ``config.json``). It also checks that
``--ref-load`` exists: run the dry run where the job's paths are (a login node), or make them. On a host without
CUDA or torch_npu, Megatron's device-architecture query is answered from the host (``train.cpu_device_properties``);
MindSpeed's own argument checks run only where MindSpeed is installed. Not run: any step of the job (no Ray, no
device; an emulated-device step is not part of the dry run yet).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .command import ArgumentParser, UserError

RESULT = "SLIME-ASCEND-DRYRUN "
_ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PYTHON = re.compile(r"^python[0-9.]*$")
# slime's args the placement check reads (the child reports them)
PLACEMENT_ARGS = ("actor_num_nodes", "actor_num_gpus_per_node", "num_gpus_per_node", "rollout_num_gpus",
                  "rollout_num_gpus_per_engine", "colocate", "rollout_external", "debug_train_only",
                  "debug_rollout_only", "use_critic")


@dataclasses.dataclass
class Launch:
    """A launch command taken apart: the job's environment (beyond this shell's), slime's script and its flags."""

    env: dict[str, str]
    script: str
    argv: list[str]


def _runtime_env_vars(value: str) -> dict[str, str]:
    try:
        data = json.loads(value)
    except json.JSONDecodeError as exc:
        raise UserError(f"--runtime-env-json is not JSON ({exc.msg} at character {exc.pos}). Fix: pass the JSON "
                        "as the shell expands it for `ray job submit`") from None
    env = data.get("env_vars", {}) if isinstance(data, dict) else {}
    if not isinstance(env, dict):
        raise UserError("--runtime-env-json: env_vars is not an object. Fix: {\"env_vars\": {\"NAME\": \"value\"}}")
    return {str(k): str(v) for k, v in env.items()}


def split_launch(words: list[str]) -> Launch:
    """``[VAR=value ...] [env ...] [ray job submit [--runtime-env-json JSON] ... --] [python [opts]] SCRIPT.py FLAGS``
    or slime's ``FLAGS`` alone (script ``train.py``)."""
    env: dict[str, str] = {}
    words = list(words)
    if words and words[0] == "env":
        words = words[1:]
    while words and _ENV_WORD.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if words[:3] == ["ray", "job", "submit"]:
        if "--" not in words:
            raise UserError("`ray job submit` without `--` before the entrypoint. Fix: ray job submit ... -- python3 "
                            "train.py FLAGS")
        cut = words.index("--")
        options, words = words[3:cut], words[cut + 1:]
        for i, word in enumerate(options):
            if word == "--runtime-env-json" and i + 1 < len(options):
                env.update(_runtime_env_vars(options[i + 1]))
            elif word.startswith("--runtime-env-json="):
                env.update(_runtime_env_vars(word.split("=", 1)[1]))
    if words and _PYTHON.match(Path(words[0]).name):
        words = words[1:]
        while words and words[0].startswith("-") and not words[0].endswith(".py"):
            if words[0] == "-m":
                raise UserError(f"`python -m {words[1] if len(words) > 1 else ''}`: the dry run reads slime's script "
                                "launch. Fix: python train.py FLAGS (or train_async.py)")
            words = words[1:]
    if words and words[0].endswith(".py"):
        return Launch(env, words[0], words[1:])
    if words and words[0].startswith("--"):
        return Launch(env, "train.py", words)
    raise UserError(f"no slime script in the command ({shlex.join(words[:3]) or 'nothing'} ...). Fix: give the "
                    "launch as `-- python train.py FLAGS`, `-- ray job submit ... -- python3 train.py FLAGS` or "
                    "`-- FLAGS`")


def _flag_value(argv: list[str], flag: str) -> tuple[int, str] | None:
    """``(index of the word holding the value, value)`` of ``flag`` (``--flag V`` or ``--flag=V``), or None."""
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            return i + 1, argv[i + 1]
        if word.startswith(flag + "="):
            return i, word.split("=", 1)[1]
    return None


def _with_hf_config(argv: list[str], hf_config: str | None) -> tuple[list[str], str | None]:
    """``argv`` with ``--hf-checkpoint`` read from ``hf_config`` where given; the problem when slime's parse_args
    could not read the model's config here."""
    found = _flag_value(argv, "--hf-checkpoint")
    if hf_config is None:
        if found is not None and not (Path(found[1]) / "config.json").is_file():
            return argv, (f"--hf-checkpoint {found[1]}: no config.json on this host, and slime's parse_args reads "
                          "it. Fix: rerun the dry run with --hf-config DIR (a directory holding the model's "
                          "config.json)")
        return argv, None
    if not (Path(hf_config) / "config.json").is_file():
        raise UserError(f"--hf-config {hf_config}: no config.json there. Fix: a directory holding the model's "
                        "config.json")
    if found is None:
        return [*argv, "--hf-checkpoint", hf_config], None
    at, _ = found
    argv = list(argv)
    argv[at] = f"--hf-checkpoint={hf_config}" if argv[at].startswith("--hf-checkpoint=") else hf_config
    return argv, None


def _plugins(option: str | None, env: Mapping[str, str]) -> tuple[str, list[str]]:
    """The plugin list and the problems with it (empty when parse_args can run with it)."""
    from .plugins import registry
    from .plugins.runtime import ENV

    value = option if option is not None else env.get(ENV, os.environ.get(ENV, ""))
    if not value.strip():
        return "", [f"plugins: {ENV} is not set for the job, so no slime-ascend plugin would run on the cluster "
                    f"(slime would ask Ray for GPUs). Fix: export {ENV}=npu,... (the value `slime-ascend config` "
                    "printed) before `ray start` and in the job's runtime env, or pass --plugins"]
    try:
        names = list(registry.resolve_selection(registry.parse_names(value)).names)
    except (registry.PluginError, ValueError) as exc:
        return value, [f"plugins: {' '.join(str(exc).split())}"]
    problems = []
    if "npu" not in names:
        problems.append(f"plugins: {ENV}={value} has no npu: slime would ask Ray for GPUs and use NCCL. Fix: add npu "
                        "(sglang-npu and vllm-ascend bring it in)")
    if "cpu" in names:
        problems.append(f"plugins: {ENV}={value} has cpu, which runs npu on the host, without the NPUs. Fix: drop cpu "
                        "for the cluster")
    return value, problems


def placement_problems(found: Mapping[str, Any], nodes: int | None, npus_per_node: int | None,
                       environ: Mapping[str, str]) -> list[str]:
    """slime's placement group (``found``: the child's report) against the cluster declared for the job."""
    per_node = npus_per_node or int(found.get("num_gpus_per_node") or 8)
    need = int(found["npus_needed"])
    declared = None
    override = environ.get("RAY_OVERRIDE_RESOURCES")
    if nodes is None and override:
        try:
            declared = json.loads(override).get("NPU")
        except (json.JSONDecodeError, AttributeError):
            declared = None
    if declared is not None:
        have, how = float(declared), "RAY_OVERRIDE_RESOURCES' NPU"
    else:
        count = nodes if nodes is not None else int(found.get("actor_num_nodes") or 1)
        source = "--nodes" if nodes is not None else "--actor-num-nodes"
        have, how = count * per_node, f"{count} node(s) ({source}) of {per_node} NPUs"
    problems = []
    actor_nodes = int(found.get("actor_num_nodes") or 1)
    actor_per_node = int(found.get("actor_num_gpus_per_node") or 0)
    if actor_per_node > per_node:
        problems.append(f"placement: --actor-num-gpus-per-node {actor_per_node} is more than the {per_node} NPUs of a "
                        f"node. Fix: at most {per_node}, with --actor-num-nodes {math.ceil(actor_nodes * actor_per_node / per_node)}")
    per_engine = int(found.get("rollout_num_gpus_per_engine") or 1)
    if per_engine > per_node and per_engine % per_node:
        problems.append(f"placement: --rollout-num-gpus-per-engine {per_engine} spans nodes of {per_node} NPUs "
                        "unevenly (an engine takes whole nodes once it outgrows one). Fix: a divisor or a multiple "
                        f"of {per_node}")
    if need > have:
        problems.append(f"placement: slime's placement group asks Ray for {need} NPUs (train actors "
                        f"{actor_nodes} x {actor_per_node}{'' if found.get('colocate') else ', plus the engines'}), "
                        f"but the cluster has {have:g} ({how}); Ray would wait for ever. Fix: fewer NPUs in the "
                        "command, or declare the cluster with --nodes N --npus-per-node N")
    return problems


# the job's variables that would configure this host's torch (its allocator parses them at import) or load a
# library into the subprocess: checked as the job's, never set here
_NOT_HERE = re.compile(r"^(PYTORCH_[A-Z]*ALLOC_CONF|LD_PRELOAD)$")


def job_environ(launch: Launch) -> dict[str, str]:
    """The job's environment as far as this host can tell: this shell's, plus the command's own variables."""
    return {**os.environ, **launch.env}


def _child_env(job_env: Mapping[str, str], plugins: str, slime_src: str | None) -> dict[str, str]:
    from .plugins.runtime import ENV

    env = {k: v for k, v in job_env.items() if not _NOT_HERE.match(k)}
    env.update({ENV: plugins, "HF_HUB_OFFLINE": "1"})
    # the job's PYTHONPATH names the cluster's folders: this host's (and --slime-src) come first
    paths = (slime_src, os.environ.get("PYTHONPATH"), job_env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    return env


def run(launch: Launch, plugins: str, *, hf_config: str | None = None, slime_src: str | None = None,
        nodes: int | None = None, npus_per_node: int | None = None, timeout: float = 600) -> tuple[list[str], dict]:
    """Problems of ``launch`` with ``plugins`` (one line each) and what slime's parse_args reported."""
    from .accelerator.launch import ray_npu_detection_problem

    argv, hf_problem = _with_hf_config(launch.argv, hf_config)
    config = _flag_value(argv, "--custom-config-path")
    problems = [hf_problem] if hf_problem else []
    if config is not None and not Path(config[1]).is_file():
        problems.append(f"--custom-config-path {config[1]}: no such file here. Fix: write it with `slime-ascend "
                        "config <plugins> -o FILE` and pass its path")
    if problems:
        return problems, {}
    job_env = job_environ(launch)
    env = _child_env(job_env, plugins, slime_src)
    payload = json.dumps({"script": launch.script, "argv": argv, "job_env": job_env})
    try:
        done = subprocess.run([sys.executable, "-c", "from slime_ascend.dryrun import _child; _child()"],
                              input=payload, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return [f"slime: parse_args did not return within {timeout:g} s. Fix: rerun with SLIME_ASCEND_TRACEBACK=1 "
                "and report it"], {}
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if not lines:
        return [f"slime: {_last_error(done.stderr)}"], {}
    found = json.loads(lines[-1][len(RESULT):])
    problems = list(found["problems"])
    if found.get("args"):
        problems += placement_problems(found["args"], nodes, npus_per_node, job_env)
    ray = ray_npu_detection_problem()
    if ray:
        problems.append(ray)
    return list(dict.fromkeys(problems)), found


def _last_error(stderr: str) -> str:
    """slime's own refusal: argparse's ``error:`` line, else the last line (an assertion, a missing module)."""
    lines = [" ".join(line.split()) for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"(^|: )error: ", line)]
    return (errors or lines or ["parse_args failed with no message"])[-1]


def _child() -> None:
    """In the subprocess (plugins activated by the bootstrap): slime's parse_args on the command, then every check."""
    payload = json.loads(sys.stdin.read())
    from .compat import typing_override
    from .plugins import roles

    typing_override.ensure()
    roles.on_entry(lambda args, role: None)  # every check below, not only the first refusal of the driver's
    sys.argv = [payload["script"], *payload["argv"]]
    result: dict[str, Any] = {"problems": [], "args": None}
    _device_query_here()
    unknown = _record_unknown_flags()
    try:
        from slime.utils.arguments import parse_args

        args = parse_args()
    except SystemExit as exc:
        if exc.code not in (0, None):
            sys.stdout.flush()
            return  # argparse printed its error line; the parent reads it
        raise
    except ImportError as exc:
        result["problems"].append(f"slime: {exc}. Fix: install slime and its stack here (or pass --slime-src DIR): "
                                  "the dry run runs slime's own parse_args")
        print(RESULT + json.dumps(result), flush=True)
        return
    except Exception as exc:  # noqa: BLE001 - slime's own refusal (an assertion, a ValueError) is the report
        text = " ".join(str(exc).split()) or "(no message)"
        result["problems"].append(f"slime: parse_args refused the command: {type(exc).__name__}: {text}")
        print(RESULT + json.dumps(result), flush=True)
        return
    ignored = sorted(set.intersection(*unknown)) if unknown else []
    if ignored:
        result["problems"].append(f"slime: {', '.join(ignored)}: no parser of slime's (slime, Megatron, SGLang) knows "
                                  "it, and slime ignores it without a word. Fix: correct the spelling, or drop it")
    result["problems"] += _checks(args, payload["job_env"])
    result["args"] = {**{k: getattr(args, k, None) for k in PLACEMENT_ARGS}, "npus_needed": _npus_needed(args)}
    print(RESULT + json.dumps(result, default=str), flush=True)


def _device_query_here() -> None:
    """Megatron's ``validate_args`` reads ``torch.cuda.get_device_properties`` at TP or CP above 1; on the cluster
    torch_npu's ``transfer_to_npu`` answers it from the NPU. On a host with neither CUDA nor torch_npu the ledger's
    ``train.cpu_device_properties`` answers it from the host (architecture 10: no CUDA work-queue limit), installed
    as Megatron-core is imported, as the cpu plugin declares it."""
    from . import host
    from .plugins.base import PatchUse
    from .startup import patch_plan

    if not host.torch_npu_installed():
        patch_plan.register_at_import([PatchUse("train.cpu_device_properties", "import:megatron.core",
                                                when="slime_ascend.cpu.plugin.host_without_cuda")])


def _record_unknown_flags() -> list[set[str]]:
    """slime parses its command line with several parsers, each ignoring what it does not know (slime's phase one,
    SGLang's, Megatron's with slime's): record each one's leftover flags; a flag every one left over is unknown."""
    import argparse

    seen: list[set[str]] = []
    original = argparse.ArgumentParser.parse_known_args

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = original(self, args, namespace)
        if args is None or list(args) == sys.argv[1:]:
            seen.append({w.split("=", 1)[0] for w in rest if w.startswith("--")})
        return parsed, rest

    argparse.ArgumentParser.parse_known_args = parse_known_args  # this subprocess only: it exits after the report
    return seen


def _checks(args: Any, job_env: Mapping[str, str]) -> list[str]:
    """Every plugin's start-up validation (the first refusal, as the driver would stop there), then each launch
    check on its own, against the job's environment."""
    from .accelerator import launch
    from .command import UserError
    from .plugins import runtime
    from .plugins.settings import SettingsError
    from .rollout.backends import sglang_npu

    problems = []
    try:
        runtime.raise_activation_error(" in the driver")
        names = runtime.enabled_names(args)
        runtime.check(args)
    except (UserError, SettingsError) as exc:  # PluginError is a UserError
        problems.append(" ".join(str(exc).split()))
        names = runtime.registry.parse_names(os.environ.get(runtime.ENV, ""))
    if "npu" in names:
        problems += launch.problems(args, job_env, on_device="cpu" not in names)
    if "sglang-npu" in names:
        hccl = sglang_npu.hccl_problem(args, job_env)
        if hccl:
            problems.append(hccl)
    return problems


def _npus_needed(args: Any) -> int:
    from .cpu.ray_capacity import placement_bundles

    return placement_bundles(args)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="slime-ascend dryrun", description=__doc__.split("\n\n")[0],
                       epilog="example: slime-ascend dryrun --hf-config ./qwen3-8b-config -- python train.py "
                              "--actor-num-gpus-per-node 8 ... --colocate --custom-config-path ascend.yaml")
    p.add_argument("--plugins", default=None,
                   help="comma-separated plugins of the job (default: SLIME_ASCEND_PLUGINS of the command's "
                        "environment, else of this shell)")
    p.add_argument("--hf-config", metavar="DIR", default=None,
                   help="a directory with the model's config.json, read in place of --hf-checkpoint (which slime's "
                        "parse_args reads) where that is not on this host")
    p.add_argument("--slime-src", metavar="DIR", default=None, help="THUDM/slime source tree to import slime from")
    p.add_argument("--nodes", type=int, default=None,
                   help="Ascend nodes the Ray cluster will have (default: the launch command's --actor-num-nodes)")
    p.add_argument("--npus-per-node", type=int, default=None,
                   help="NPUs per node (default: the launch command's --num-gpus-per-node, slime's default 8)")
    p.add_argument("--timeout", type=float, default=600, help="seconds slime's parse_args may take (default 600)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" not in argv:
        if any(a in ("-h", "--help") for a in argv):
            build_parser().parse_args(["--help"])
        raise UserError("no launch command. Fix: slime-ascend dryrun [options] -- python train.py FLAGS")
    cut = argv.index("--")
    ns = build_parser().parse_args(argv[:cut])
    for name in ("nodes", "npus_per_node"):
        if getattr(ns, name) is not None and getattr(ns, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} {getattr(ns, name)}: must be at least 1. Fix: the cluster's "
                            "count")
    launch = split_launch(argv[cut + 1:])
    plugins, problems = _plugins(ns.plugins, launch.env)
    if not plugins or any(p.startswith("plugins: ") and "Fix: add npu" not in p and "drop cpu" not in p
                          for p in problems):
        for line in problems:
            print(line)
        return 1
    more, found = run(launch, plugins, hf_config=ns.hf_config, slime_src=ns.slime_src, nodes=ns.nodes,
                      npus_per_node=ns.npus_per_node, timeout=ns.timeout)
    problems += more
    for line in problems:
        print(line)
    if problems:
        return 1
    args = found.get("args") or {}
    print(f"ok: slime's parse_args and the plugins' checks ({plugins}) accept the command; it asks Ray for "
          f"{args.get('npus_needed')} NPUs")
    return 0

"""Run slime's own ``train.py`` / ``train_async.py`` on this CPU with the ``cpu`` plugin.

A tiny Qwen3 (vocab 1024, hidden 64, 2 layers) and a byte-level tokenizer are made locally, a
prompt set is written as JSONL, torch engines serve on 127.0.0.1 (slime reaches them through its
own sglang router, ``--rollout-external-engine-addrs``), and weights sync through
``--update-weight-transport disk``. Nothing of slime or Megatron is edited; slime is found by
:func:`slime_src`. Used by ``slime-ascend demo --slime-src`` and by ``tests/e2e``.

The evidence the tests read comes from slime's own output: its log lines and the step metrics it
prints (``log_rollout_data`` / ``log_perf_data``), and the files it writes.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# the directory holding the slime_ascend package: put on the job's PYTHONPATH so that every process
# slime starts imports this copy
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


class SlimeNotFound(RuntimeError):
    """No slime source tree (with ``train.py`` / ``train_async.py``) was given or importable."""


def is_slime_tree(path: Path) -> bool:
    """THUDM/slime's source tree (its accelerator registry and train scripts), not the PyPI namesake."""
    return (path / "slime" / "utils" / "accelerator" / "__init__.py").is_file() and (path / "train.py").is_file()


def slime_src(explicit: str | os.PathLike | None = None) -> Path:
    """The slime source tree to run: ``explicit``, else ``$SLIME_SRC``, else the tree ``import slime``
    finds. Raises :class:`SlimeNotFound` naming what to set."""
    import importlib.util

    if explicit is not None or os.environ.get("SLIME_SRC"):
        path = Path(explicit if explicit is not None else os.environ["SLIME_SRC"]).expanduser().resolve()
        if not is_slime_tree(path):
            what = "--slime-src" if explicit is not None else "SLIME_SRC"
            raise SlimeNotFound(f"{what}={path} is not a THUDM/slime source tree (no slime/utils/accelerator "
                                "or train.py there); point it at a clone of github.com/THUDM/slime")
        return path
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec("slime")
        if spec is not None and spec.submodule_search_locations:
            root = Path(next(iter(spec.submodule_search_locations))).resolve().parent
            if is_slime_tree(root):
                return root
    raise SlimeNotFound("no THUDM/slime source tree found: pass --slime-src DIR or set SLIME_SRC to a clone of "
                        "github.com/THUDM/slime")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Qwen3 architecture flags for the tiny model (slime's scripts/models/qwen3-*.sh, resized)
TINY_QWEN3_ARGS = (
    "--swiglu --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
    "--group-query-attention --num-query-groups 2 --use-rotary-position-embeddings --disable-bias-linear "
    "--normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 10000 --vocab-size 1024 --kv-channels 16 "
    "--qk-layernorm --untie-embeddings-and-output-weights"
)

# the tiny Qwen3-MoE (make_model(moe=True)): the dense flags plus slime's scripts/models/qwen3-30B-A3B.sh MoE flags,
# resized (4 experts, top 2, layer 0 dense), less --moe-grouped-gemm and --moe-permute-fusion (TransformerEngine)
TINY_QWEN3_MOE_ARGS = (
    TINY_QWEN3_ARGS + " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-layer-freq [0,1] "
    "--moe-router-score-function softmax --moe-token-dispatcher-type alltoall --moe-token-drop-policy probs "
    "--moe-router-dtype fp32 --moe-aux-loss-coeff 0"
)

PROMPTS = [f"Q{i}: what is {i} plus {i % 3}?" for i in range(32)]


def make_model(out_dir: Path, seed: int = 0, moe: bool = False, config_overrides: dict | None = None) -> Path:
    """The tiny random Qwen3 (``moe``: Qwen3-MoE, flags :data:`TINY_QWEN3_MOE_ARGS`) with its tokenizer, as an
    HF safetensors directory (bf16 weights); ``config_overrides``: fields of its config changed (``load_model``)."""
    import torch

    from slime_ascend.rollout.torch_engine.model import build_byte_tokenizer, load_model, save_model

    if (out_dir / "config.json").is_file():
        return out_dir
    model = load_model(None, dtype=torch.float32, seed=seed, moe=moe, config_overrides=config_overrides
                       ).to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    save_model(model, out_dir, build_byte_tokenizer())
    return out_dir


def make_prompts(path: Path, n: int = 32, domains: tuple[str, ...] = ()) -> Path:
    with path.open("w") as f:
        for i, text in enumerate(PROMPTS[:n]):
            row = {"prompt": text, "label": str(i + i % 3)}
            if domains:
                row["metadata"] = {"domain": domains[i % len(domains)]}
            f.write(json.dumps(row) + "\n")
    return path


@dataclasses.dataclass
class Engine:
    url: str
    proc: subprocess.Popen
    log: Path

    @property
    def addr(self) -> str:
        return self.url.removeprefix("http://")


def _spawn_engine(model_dir: Path, log: Path, engine_args: tuple[str, ...] = (),
                  extra_env: dict[str, str] | None = None) -> Engine:
    """``slime-ascend serve-torch`` on 127.0.0.1 (with ``engine_args``, ``extra_env`` added to its environment)
    started (not waited for)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "SLIME_ASCEND_PLUGINS"}
    env.update(extra_env or {})
    cmd = [sys.executable, "-m", "slime_ascend.cli", "serve-torch", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), *engine_args]
    with log.open("w") as fh:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=str(log.parent),
                                start_new_session=True)
    return Engine(f"http://127.0.0.1:{port}", proc, log)


def _wait_healthy(eng: Engine, deadline: float, timeout: float) -> None:
    """Until ``eng`` answers /health; stopped, with its log in the error, when it exits or ``deadline`` passes."""
    from slime_ascend.json_client import JSONRequestError, request_json

    while time.monotonic() < deadline:
        if eng.proc.poll() is not None:
            raise RuntimeError(f"torch engine exited ({eng.proc.returncode}):\n{eng.log.read_text()[-3000:]}")
        with contextlib.suppress(JSONRequestError):
            request_json(eng.url + "/health", timeout_s=2)
            return
        time.sleep(0.1)
    stop(eng.proc)
    raise RuntimeError(f"torch engine did not answer /health within {timeout}s:\n{eng.log.read_text()[-3000:]}")


def _wait_listening(eng: Engine, deadline: float, timeout: float) -> None:
    """Until ``eng``'s port accepts a connection (serve-torch listens before it loads the model)."""
    port = int(eng.url.rsplit(":", 1)[1])
    while time.monotonic() < deadline:
        if eng.proc.poll() is not None:
            raise RuntimeError(f"torch engine exited ({eng.proc.returncode}):\n{eng.log.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        time.sleep(0.05)
    stop(eng.proc)
    raise RuntimeError(f"torch engine did not listen within {timeout}s:\n{eng.log.read_text()[-3000:]}")


def start_engine(model_dir: Path, log: Path, timeout: float = 120, *, ready: bool = True,
                 engine_args: tuple[str, ...] = (), extra_env: dict[str, str] | None = None) -> Engine:
    """``slime-ascend serve-torch`` on 127.0.0.1 (with ``engine_args``, e.g. ``--enable-return-routed-experts``, and
    ``extra_env`` in its environment, e.g. ``SLIME_ASCEND_EMULATE_NPU=1`` beside ``--device npu``), waited for until
    /health answers.

    ``ready=False``: returned as soon as its port accepts connections, while it still imports torch and loads the
    model (3-5 s on a 2-core host); a request sent meanwhile waits in its accept queue and is answered once the
    model is loaded. For a caller that starts slime next: slime's own start (imports, Ray) overlaps the load,
    and slime's first request to the engine (its server-info query, 30 s timeout) waits for it."""
    eng = _spawn_engine(model_dir, log, engine_args, extra_env)
    (_wait_healthy if ready else _wait_listening)(eng, time.monotonic() + timeout, timeout)
    return eng


def start_engines(model_dirs: list[Path], logs: list[Path], timeout: float = 120, *, ready: bool = True
                  ) -> list[Engine]:
    """:func:`start_engine` (with ``ready``) for each (model dir, log) pair, all started at once and then each
    waited for, so that their imports and model loads overlap. If one fails to come up, every one is stopped and
    the error is raised."""
    if len(model_dirs) != len(logs):
        raise ValueError(f"start_engines: {len(model_dirs)} model dirs but {len(logs)} logs; give one log per engine")
    engines: list[Engine] = []
    try:
        for model_dir, log in zip(model_dirs, logs):
            engines.append(_spawn_engine(model_dir, log))
        deadline = time.monotonic() + timeout
        for eng in engines:
            (_wait_healthy if ready else _wait_listening)(eng, deadline, timeout)
    except BaseException:
        for eng in engines:
            stop(eng.proc)
        raise
    return engines


def _ignores_sigint(pid: int) -> bool:
    """Whether ``pid`` ignores SIGINT (Linux's /proc; False where it cannot be read). A process started from a
    background job of a non-interactive shell inherits SIGINT ignored, and Python then installs no handler."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(ln.split()[1], 16) for ln in f if ln.startswith("SigIgn:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return False
    return bool(mask >> (signal.SIGINT - 1) & 1)


def stop(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGINT to ``proc``'s process group (SIGTERM when it ignores SIGINT), SIGKILL after ``timeout`` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM if _ignores_sigint(proc.pid) else signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)


def slime_flags(model_dir: Path, prompts: Path, engines: list[Engine], work: Path, *, num_rollout: int = 2,
                batch: int = 4, n_samples: int = 2, max_response: int = 8, save: bool = True) -> list[str]:
    """A GRPO job on the tiny model: one train actor on the host, external torch engine(s).

    ``save``: slime writes its Megatron checkpoint to ``work/ckpt`` after the last rollout (``--save``); a
    test that reads no checkpoint passes ``save=False`` (no ``--save``: the torch_dist save costs 4-9 s per
    run on a 2-core host)."""
    disk = work / "weights"
    disk.mkdir(exist_ok=True)
    save_flags = f"--save {work / 'ckpt'} --save-interval 1000" if save else ""
    flags = f"""
      --hf-checkpoint {model_dir} --load {model_dir} {save_flags}
      {TINY_QWEN3_ARGS}
      --prompt-data {prompts} --input-key prompt --label-key label --metadata-key metadata
      --rm-type random --num-rollout {num_rollout} --rollout-batch-size {batch}
      --n-samples-per-prompt {n_samples} --rollout-max-response-len {max_response} --rollout-temperature 1.0
      --global-batch-size {batch * n_samples} --micro-batch-size 1
      --seq-length 256 --max-position-embeddings 4096
      --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28
      --optimizer adam --lr 1e-4 --lr-decay-style constant --weight-decay 0.0 --adam-beta1 0.9 --adam-beta2 0.98
      --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1
      --actor-num-nodes 1 --actor-num-gpus-per-node 1 --rollout-num-gpus 1 --rollout-num-gpus-per-engine 1
      --rollout-external-engine-addrs {' '.join(e.addr for e in engines)}
      --update-weight-mode full --update-weight-transport disk --update-weight-disk-dir {disk}
      --attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32
      --attention-softmax-in-fp32 --bf16 --seed 1234
    """
    return shlex.split(flags)


@dataclasses.dataclass
class Run:
    returncode: int
    log: str
    seconds: float
    tensorboard_dir: Path | None = None  # where slime's trackers wrote (``--use-tensorboard``)

    def tracked(self) -> dict[str, list[tuple[int, float]]]:
        """What slime sent to its trackers: every scalar in the TensorBoard event files of every process
        (driver, RolloutManager, train actors), as ``tag -> [(step, value), ...]`` in step order."""
        return read_tensorboard(self.tensorboard_dir) if self.tensorboard_dir else {}

    def metrics(self, prefix: str = "") -> list[dict]:
        """The step-metric dicts slime logged (``... : {'rollout/...': ...}`` lines), in order."""
        out = []
        for match in re.finditer(r"(\{'[a-z_]+/[^\n]*\})\s*$", self.log, re.MULTILINE):
            with contextlib.suppress(ValueError, SyntaxError):
                value = ast.literal_eval(match.group(1))
                if isinstance(value, dict) and (not prefix or any(str(k).startswith(prefix) for k in value)):
                    out.append(value)
        return out

    def metric_keys(self) -> set[str]:
        return {k for m in self.metrics() for k in m}


# slime's labels (rollout, step, perf, eval) and the plugins' own rollout reports (staleness, tito, ...:
# slime_ascend.plugins.rollout_metrics), each "<label> <rollout id>: {'<group>/<name>': ...}"
_LABELLED_METRICS = re.compile(r"\b([a-z][a-z0-9_]*) (\d+): (\{'[a-z_]+/[^\n]*\})\s*$", re.MULTILINE)


def read_tensorboard(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars of every TensorBoard event file under ``directory``: ``tag -> [(step, value), ...]``."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(directory).rglob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.HasField("tensor"):
                    scalar = float(tensor_util.make_ndarray(value.tensor))
                elif value.HasField("simple_value"):
                    scalar = float(value.simple_value)
                else:
                    continue
                out.setdefault(value.tag, []).append((int(event.step), scalar))
    return {tag: sorted(points) for tag, points in sorted(out.items())}


def parse_rollout_metrics(text: str) -> dict[int, dict]:
    """slime's labelled metric dicts (``rollout N: {...}``, ``step N: {...}``, ``perf N: {...}``, and the
    plugins' ``<name> N: {...}`` rollout reports) merged by N.

    With one train step per rollout (global batch = rollout batch x samples), the train step N is
    rollout N, so each entry holds everything slime logged for that rollout."""
    out: dict[int, dict] = {}
    for match in _LABELLED_METRICS.finditer(text):
        with contextlib.suppress(ValueError, SyntaxError):
            value = ast.literal_eval(match.group(3))
            if isinstance(value, dict):
                out.setdefault(int(match.group(2)), {}).update(value)
    return dict(sorted(out.items()))


# The local Ray cluster slime's first Ray call starts in the driver advertises one logical CPU per core;
# slime asks for one per device bundle, one for the RolloutManager and one for its lock actor, more than
# a 2-core host has. Logical CPUs are scheduling tokens, not cores: Ray's RAY_OVERRIDE_RESOURCES sets them.
RAY_LOGICAL_CPUS = 8


def job_env(plugins: tuple[str, ...], extra_env: dict[str, str] | None = None, src: Path | None = None
            ) -> dict[str, str]:
    """The job's environment; a ``PYTHONPATH`` in ``extra_env`` is added to the job's, not put in its place."""
    src = src or slime_src()
    extra_env = dict(extra_env or {})
    extra_path = extra_env.pop("PYTHONPATH", "")
    env = dict(os.environ)
    env.update({
        "SLIME_ASCEND_PLUGINS": ",".join(plugins),
        "PYTHONPATH": os.pathsep.join(p for p in [str(src), str(PACKAGE_ROOT), extra_path,
                                                  env.get("PYTHONPATH", "")] if p),
        "SLIME_HOST_IP": "127.0.0.1",
        "RAY_DEDUP_LOGS": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        # npu on the host (plugins cpu,npu): Ray advertises NPU, as it does by itself on an Ascend host
        "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": RAY_LOGICAL_CPUS, **({"NPU": RAY_LOGICAL_CPUS}
                                                                        if "npu" in plugins else {})}),
        # every Ray worker imports torch at start (the plugin bootstrap); on a loaded 2-core host that can
        # take longer than Ray's 60 s registration timeout ("worker startup repeatedly failed")
        "RAY_worker_register_timeout_seconds": "600",
    })
    env.update(extra_env)
    return env


def plugin_flags(plugins: tuple[str, ...]) -> list[str]:
    """The flags ``slime-ascend config PLUGIN... --flags`` prints, as a launch script uses them: the same
    :func:`slime_ascend.config.build` the command calls, in this process (a ``slime-ascend`` subprocess per
    run cost a Python start and a torch import, 3-15 s on a 2-core host)."""
    from slime_ascend import config

    return shlex.split(config.build(list(plugins)).flags_line())


def run_slime(script: str, flags: list[str], work: Path, plugins: tuple[str, ...], *,
              custom_config: Path | None = None, extra_env: dict[str, str] | None = None,
              timeout: float = 900, src: Path | None = None) -> Run:
    """Run slime's ``script`` (train.py / train_async.py) from ``src`` (default :func:`slime_src`) with
    ``plugins`` enabled."""
    src = src or slime_src()
    cmd = [sys.executable, str(src / script), *flags]
    if custom_config is not None:
        cmd += ["--custom-config-path", str(custom_config)]
    cmd += plugin_flags(plugins)
    # slime's trackers: every process writes TensorBoard events here (what wandb would get too)
    tensorboard_dir = work / "tensorboard"
    extra_env = {"TENSORBOARD_DIR": str(tensorboard_dir), **(extra_env or {})}
    if "--use-tensorboard" not in cmd:
        cmd.append("--use-tensorboard")
    env = job_env(plugins, extra_env, src)
    log_path = work / f"{Path(script).stem}.log"
    start = time.monotonic()
    for attempt in (1, 2):
        with log_path.open("w") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=str(work),
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
            except subprocess.TimeoutExpired:
                stop(proc)
                rc = -9
        log = log_path.read_text(errors="replace")
        if rc == 0 or attempt == 2 or not ray_start_timed_out(log):
            break
        # nothing of the job ran: slime's first Ray call could not start the local cluster
        print(f"slime job in {work}: Ray's local cluster did not start within Ray's fixed 30 s (a loaded host); "
              "starting the job once more", file=sys.stderr, flush=True)
        (work / f"{Path(script).stem}.ray-start-timeout.log").write_text(log)
    return Run(rc, log, time.monotonic() - start, Path(env["TENSORBOARD_DIR"]))


# Ray's Node() gives the raylet a fixed 30 s to register with the GCS (ray/_private/node.py, raylet_start_wait_time_s);
# on a 2-core host busy with other work it can miss it, before any of the job has run
_RAY_START_TIMEOUT = "The current node timed out during startup."


def ray_start_timed_out(log: str) -> bool:
    """Whether a slime job's log ends in Ray's local-cluster start timeout, before slime made any Ray actor."""
    return _RAY_START_TIMEOUT in log and "Creating placement group" in log and "MegatronTrainRayActor" not in log

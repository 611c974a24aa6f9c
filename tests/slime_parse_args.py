"""slime's own ``parse_args`` on a tiny dense Qwen3's command line, in a subprocess with the plugin bootstrap: what a
job's driver refuses (or accepts) before Ray starts, as ``train.py`` would.

:func:`parse_args_each` runs several command lines for the imports of one: one subprocess per plugin set and
environment imports slime's arguments once, then forks a child per command line, which runs slime's ``parse_args``
and exits as a fresh ``python -c`` of :func:`parse_args` would (its own output and exit status, no state
from another case)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

# a tiny Qwen3 (the checkpoint :func:`parse_args` writes), one colocated train rank, 2 rollouts
TINY_FLAGS = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
              "--num-query-groups 2 --kv-channels 16 --seq-length 256 --max-position-embeddings 256 "
              "--normalization RMSNorm --norm-epsilon 1e-6 --qk-layernorm --swiglu --disable-bias-linear "
              "--untie-embeddings-and-output-weights --position-embedding-type rope "
              "--vocab-size 1024 --micro-batch-size 1 --rollout-batch-size 4 --n-samples-per-prompt 1 "
              "--global-batch-size 4 --actor-num-nodes 1 --actor-num-gpus-per-node 1 --colocate --num-rollout 2").split()

FORKED = "PARSE-ARGS-EACH "  # the runner's report line: the children's exit statuses, or why it did not fork

# Imports slime's arguments once, then (with several cases) forks a child per case; each child leaves the loop and
# runs its case as the script's last statements, so it ends as a fresh `python -c` would (exit status, atexit).
# A process forks safely only while it has one thread: importing torch starts none with OMP_NUM_THREADS=1, an
# OpenMP thread without; then the runner reports the count and runs nothing (the caller starts one per case).
# gc.freeze: the collector leaves the imports' objects alone, else each child's collections (its exit's above all,
# ~1.3 s) copy every page holding them.
_RUNNER = textwrap.dedent("""
    import gc, json, os, sys, threading, typing, typing_extensions
    typing.override = getattr(typing, "override", typing_extensions.override)
    cases = json.loads(sys.stdin.read())
    sys.argv = cases[0]["argv"]  # as a fresh process has it (slime's imports do not read it)
    from slime.utils.arguments import parse_args
    if len(cases) == 1:
        case = cases[0]
    else:
        threads = len(os.listdir("/proc/self/task"))
        if threads != 1 or threading.active_count() != 1:
            print({forked!r} + json.dumps({{"threads": threads}}), flush=True)
            sys.exit(0)
        gc.freeze()
        codes = []
        for case in cases:
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:
                for fd, name in ((1, "stdout"), (2, "stderr")):
                    out = os.open(case[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(out, fd)
                    os.close(out)
                break
            codes.append(os.waitstatus_to_exitcode(os.wait()[1]))
        else:
            print({forked!r} + json.dumps({{"codes": codes}}), flush=True)
            sys.exit(0)
    os.chdir(case["cwd"])
    sys.argv = case["argv"]
    parse_args()
    print("PARSED")
""").format(forked=FORKED)


@dataclasses.dataclass(frozen=True)
class Case:
    """One command line of :func:`parse_args_each`: ``where`` holds its ``hf`` checkpoint and ``ascend.yaml`` (made
    when absent) and is its working directory (None: the call's ``tmp_path``); ``flags`` come before ``argv``;
    ``env`` is added to its environment from the interpreter's start (cases differing in it run in different
    subprocesses)."""

    argv: Sequence[str] = ()
    where: Path | None = None
    flags: Sequence[str] = tuple(TINY_FLAGS)
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)


def parse_args(tmp_path: Path, plugins: list[str], *argv: str, pythonpath: tuple[str, ...] = ()
               ) -> subprocess.CompletedProcess:
    """slime's ``parse_args`` with ``SLIME_ASCEND_PLUGINS=plugins``, the YAML ``slime-ascend config plugins`` writes
    (``tmp_path/ascend.yaml``, made once) and a tiny HF checkpoint (``tmp_path/hf``), then ``argv``; prints
    ``PARSED`` when it returns. ``pythonpath``: folders the job imports from (a test's reward function)."""
    return parse_args_each(tmp_path, plugins, [argv], pythonpath=pythonpath)[0]


def parse_args_each(tmp_path: Path, plugins: list[str], cases: Sequence[Case | Sequence[str]], *,
                    pythonpath: tuple[str, ...] = ()) -> list[subprocess.CompletedProcess]:
    """:func:`parse_args` on each case (a :class:`Case`, or ``argv`` alone), one result per case, in order; the
    cases of one environment share one subprocess's imports."""
    from conftest import need

    need("slime.utils.arguments")
    cases = [c if isinstance(c, Case) else Case(tuple(c)) for c in cases]
    groups: dict[tuple, list[int]] = {}
    for i, case in enumerate(cases):
        groups.setdefault(tuple(sorted(case.env.items())), []).append(i)
    results: list[subprocess.CompletedProcess | None] = [None] * len(cases)
    for key, indices in groups.items():
        env = {**os.environ, **dict(key), "SLIME_ASCEND_PLUGINS": ",".join(plugins), "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join([*pythonpath, os.environ.get("PYTHONPATH", "")])}
        jobs = [_prepared(cases[i], tmp_path, plugins) for i in indices]
        done = _run(jobs, env)
        if done is None:  # the runner could not fork: a subprocess per case
            done = [_run([job], env)[0] for job in jobs]
        for i, proc in zip(indices, done):
            results[i] = proc
    return results


def _prepared(case: Case, tmp_path: Path, plugins: list[str]) -> dict:
    from transformers import Qwen3Config

    from slime_ascend import config

    where = case.where or tmp_path
    if not (where / "hf").exists():
        Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                    tie_word_embeddings=False).save_pretrained(where / "hf")
    if not (where / "ascend.yaml").exists():
        (where / "ascend.yaml").write_text(config.build(list(plugins)).yaml_text)
    argv = ["train.py", "--hf-checkpoint", str(where / "hf"), *case.flags, *case.argv,
            "--custom-config-path", str(where / "ascend.yaml")]
    return {"argv": argv, "cwd": str(where)}


def _run(jobs: list[dict], env: dict) -> list[subprocess.CompletedProcess] | None:
    """The runner on ``jobs``; None when it would not fork. What it printed before forking (its imports' warnings)
    heads each case's output, as each fresh process would print it."""
    with tempfile.TemporaryDirectory() as out:
        jobs = [{**job, "stdout": f"{out}/{i}.out", "stderr": f"{out}/{i}.err"} for i, job in enumerate(jobs)]
        proc = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(jobs), capture_output=True,
                              text=True, env=env, cwd=jobs[0]["cwd"], timeout=300 + 60 * len(jobs))
        if len(jobs) == 1:
            return [proc]
        report = [line for line in proc.stdout.splitlines() if line.startswith(FORKED)]
        if proc.returncode != 0 or not report:  # the shared imports failed: as each case's own process would
            return [proc] * len(jobs)
        codes = json.loads(report[-1][len(FORKED):]).get("codes")
        if codes is None:
            return None
        head = proc.stdout.replace(report[-1] + "\n", "")
        return [subprocess.CompletedProcess(job["argv"], code, head + Path(job["stdout"]).read_text(),
                                            proc.stderr + Path(job["stderr"]).read_text())
                for job, code in zip(jobs, codes)]


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """The one-line refusals the plugins printed (``slime-ascend: error: ...``)."""
    return [line for line in proc.stderr.splitlines() if line.startswith("slime-ascend: error:")]

"""The nets CI stands on (``.ci/run`` sets SLIME_ASCEND_REQUIRE_SLIME=1).

``SLIME_STACK`` is what slime's real loop imports (train.py / train_async.py, its Ray actors, the
rollout manager and engines, the sglang router with its Rust core, the Megatron train actor, slime's
tensorboard and wandb loggers, the fully-async rollout) and what tests/e2e reads its results with.
``python tests/ci_net.py`` imports each module and names every one that fails; ``.ci/run`` runs it
before the suite. ``absent()`` is its cheap form (nothing imported): tests/conftest.py skips the
``slime`` tests, saying which packages are missing, where it is not empty.

No hidden skips: under SLIME_ASCEND_REQUIRE_SLIME=1 a test marked ``slime`` or ``slow`` that skipped,
or a test module skipped whole at collection (its marks cannot be read), fails the run and is named
in the summary, unless it is one of ``ALLOWED_SKIPS``. tests/conftest.py imports these hooks; a
pytest run elsewhere loads them with ``-p ci_net`` (tests/test_ci_nets.py does).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys

import pytest

SLIME_STACK = (
    # the packages scripts/install-slime-cpu.sh installs for slime's tested paths (some are imported only deep in
    # the modules below, e.g. sglang.utils -> IPython, slime's reward models -> pylatexenc: absent() sees them here)
    "torchvision", "pybase64", "omegaconf", "blobfile", "pylatexenc", "xxhash", "zstandard", "openai",
    "partial_json_parser", "msgspec", "sentencepiece", "zmq", "dill", "einops", "orjson", "setproctitle", "uvloop",
    "gguf", "IPython",
    "ray", "transformers", "tensorboard", "tensorboard.backend.event_processing.event_file_loader",
    "torch.utils.tensorboard", "torch_memory_saver", "wandb",
    # the router: its arguments, and launch_router's deferred import of the Rust router itself
    "sglang_router.launch_router", "sglang_router.router", "sglang.srt.server_args",
    "megatron.core", "megatron.training.arguments",
    "slime.utils.accelerator", "slime.utils.arguments", "slime.utils.misc", "slime.utils.http_utils",
    "slime.ray.placement_group", "slime.ray.actor_group", "slime.ray.rollout", "slime.ray.train_actor",
    "slime.backends.megatron_utils.actor", "slime.backends.sglang_utils.sglang_engine",
    "slime.rollout.sglang_rollout", "slime.rollout.fully_async_rollout", "slime.observability.logging_utils",
)
INSTALL_HINT = "bash scripts/install-slime-cpu.sh installs them"

# (node id prefix, text of the skip reason, why CI lets it skip)
ALLOWED_SKIPS = (
    ("tests/quant/test_quant_native_targets.py::", "(Debian: apt-get install gcc-aarch64-linux-gnu",
     "the aarch64 toolchain is optional (.ci/run installs it where apt-get runs as root; "
     "SLIME_ASCEND_REQUIRE_AARCH64=1 requires it)"),
    ("tests/accelerator/test_npu_accelerator.py::", "needs a CUDA device", "CI has no GPU"),
)

REQUIRE = os.environ.get("SLIME_ASCEND_REQUIRE_SLIME") == "1"
NETTED = ("slime", "slow")


def installed(module: str) -> bool:
    """Whether ``module`` is installed, running none of its code: its first regular package is found
    (namespace packages such as ``megatron`` are walked through, they run nothing)."""
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        spec = importlib.util.find_spec(".".join(parts[:i]))
        if spec is None:
            return False
        if spec.origin is not None:
            return True
    return True


def absent(stack: tuple[str, ...] = SLIME_STACK) -> list[str]:
    """The modules of ``stack`` whose package is not installed (nothing is imported)."""
    return [m for m in stack if not installed(m)]


# megatron.training uses typing.override (Python 3.12): the cpu plugin's shim adds it on 3.11
IMPORT = "from slime_ascend.compat import typing_override; typing_override.ensure(); import {}"


def _error_alone(module: str) -> str:
    """The error of importing ``module`` alone in a fresh interpreter: a failed import leaves a package
    half-imported, and the next import of it then fails with a KeyError that hides the cause."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    res = subprocess.run([sys.executable, "-c", IMPORT.format(module)], capture_output=True, text=True, env=env,
                         timeout=900)
    if res.returncode == 0:
        return "imports alone, fails after the modules before it"
    tail = res.stderr.rpartition("Traceback (most recent call last):")[2].splitlines()
    return next((line for line in reversed(tail) if line and not line[0].isspace()), f"exit status {res.returncode}")


def import_failures(stack: tuple[str, ...] = SLIME_STACK) -> list[str]:
    """``module: error`` for every module of ``stack`` that does not import (the error it gives alone)."""
    from slime_ascend.compat import typing_override

    typing_override.ensure()
    failures = []
    for module in stack:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - reported, one line per module
            failures.append(f"{module}: {_error_alone(module)}")
    return failures


# ------------------------------------------------------------------------------------ no hidden skips

_netted: set[str] = set()
_hidden: list[str] = []


def allowed(nodeid: str, reason: str) -> bool:
    return any(nodeid.startswith(prefix) and text in reason for prefix, text, _ in ALLOWED_SKIPS)


def _reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


def pytest_collection_finish(session):
    _netted.update(item.nodeid for item in session.items if any(item.get_closest_marker(m) for m in NETTED))


def pytest_collectreport(report):
    if REQUIRE and report.skipped:
        _hidden.append(f"{report.nodeid} (skipped whole at collection): {_reason(report)}")


def pytest_runtest_logreport(report):
    if REQUIRE and report.skipped and not hasattr(report, "wasxfail") and report.nodeid in _netted:
        reason = _reason(report)
        if not allowed(report.nodeid, reason):
            _hidden.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session):
    if _hidden and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _hidden:
        terminalreporter.section(f"SLIME_ASCEND_REQUIRE_SLIME=1: {len(_hidden)} slime/slow test(s) skipped", red=True)
        for line in _hidden:
            terminalreporter.line(line)


if __name__ == "__main__":  # python tests/ci_net.py [module ...]: those modules, by default SLIME_STACK
    failed = import_failures(tuple(sys.argv[1:]) or SLIME_STACK)
    for line in failed:
        print(f"CI: does not import: {line}", file=sys.stderr)
    if failed:
        print(f"CI: slime or its dependencies do not import ({INSTALL_HINT})", file=sys.stderr)
    sys.exit(1 if failed else 0)

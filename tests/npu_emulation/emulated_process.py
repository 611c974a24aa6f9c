"""Run code in a fresh interpreter with the emulated Ascend device: installing it cannot be undone in a process
(torch's PrivateUse1 backend is named once), so the pytest process itself never installs it.

``run_checks(path)`` imports the checks file ``path`` in one subprocess (after ``install()``, with the emulated
torch_memory_saver when the file sets ``MEMORY_SAVER = True``), calls each of its ``check_*`` functions and returns
``{name: None | traceback}``; ``checks_test(path)`` is a test parametrized over those checks (listed without
importing the file) that runs the subprocess once.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MARK = "EMULATED-CHECK-RESULTS:"

_RUNNER = r"""
import importlib.util, json, sys, traceback
path, mark = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("emulated_checks", path)
module = importlib.util.module_from_spec(spec)
import slime_ascend.npu_emulation as emulation
emulation.install(memory_saver="MEMORY_SAVER = True" in open(path).read())
spec.loader.exec_module(module)
results = {}
for name in [n for n in vars(module) if n.startswith("check_")]:
    try:
        getattr(module, name)()
        results[name] = None
    except BaseException:
        results[name] = traceback.format_exc()
print(mark + json.dumps(results), flush=True)
"""


def environment(extra: dict | None = None, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """The test process's environment for a child: the repository on PYTHONPATH, no plugins or emulation unless
    ``extra`` asks, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("SLIME_ASCEND_PLUGINS", "SLIME_ASCEND_EMULATE_NPU", "SLIME_ASCEND_EMULATE_MEMORY_SAVER",
                        "ASCEND_RT_VISIBLE_DEVICES", "LD_PRELOAD") + drop}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                        if p])
    env.update(extra or {})
    return env


def run_python(code: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=environment(env), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def check_names(path: Path) -> list[str]:
    tree = ast.parse(Path(path).read_text())
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("check_")]


def run_checks(path: Path, env: dict | None = None, timeout: int = 300) -> dict[str, str | None]:
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(path), MARK], env=environment(env), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise AssertionError(f"the checks of {Path(path).name} did not report (exit {proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def checks_test(path: Path, env: dict | None = None, before: Callable[[], None] | None = None):
    """A test parametrized over the ``check_*`` functions of ``path``; the first one to run runs them all in one
    subprocess (after ``before()``, which may skip)."""
    cache: dict[str, dict] = {}

    @pytest.mark.parametrize("name", check_names(path))
    def test(name):
        if "results" not in cache:
            if before is not None:
                before()
            cache["results"] = run_checks(path, env)
        assert cache["results"][name] is None, cache["results"][name]

    return test

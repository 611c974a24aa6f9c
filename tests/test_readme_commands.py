"""The README's two commands: their shape, the torch pin they share with CI, and that CI runs command 1 as written."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("readme_command", REPO / "scripts" / "readme_command.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_commands_install_and_demo_then_tests():
    one, two = _script().commands((REPO / "README.md").read_text())
    assert re.fullmatch(r'pip install torch==[\d.]+ && pip install -e "\.\[demo\]" && slime-ascend demo --out demo-out', one)
    assert two == 'pip install -e ".[test]" && python -m pytest -q'


def test_readme_and_ci_take_the_same_torch():
    one = _script().commands((REPO / "README.md").read_text())[0]
    readme_torch = re.search(r"torch==([\d.]+)", one).group(1)
    ci_torch = re.search(r'"torch==([\d.]+)"', (REPO / "scripts" / "install-slime-cpu.sh").read_text()).group(1)
    assert readme_torch == ci_torch


def test_ci_runs_command_one_as_written_before_the_install_script():
    ci = (REPO / ".ci" / "run").read_text()
    assert "python scripts/readme_command.py 1" in ci
    assert ci.index("readme_command.py 1") < ci.index("bash scripts/install-slime-cpu.sh")

"""The transformers check of first contact: the range in pyproject, a version outside it, a leftover ``kernels``."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

from slime_ascend.compat import transformers_stack

REPO = Path(__file__).resolve().parents[2]


def test_range_is_pyprojects():
    """Every extra that installs transformers asks for exactly the range the check enforces."""
    text = (REPO / "pyproject.toml").read_text()
    ranges = re.findall(r'"transformers([^"]*)"', text)
    assert ranges and set(ranges) == {transformers_stack.SUPPORTED}


def test_installed_transformers_passes():
    pytest.importorskip("transformers")
    assert transformers_stack.problem() is None


def _fake_versions(monkeypatch, **versions):
    def version(name):
        if versions.get(name) is None:
            raise metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(transformers_stack.metadata, "version", version)


@pytest.mark.parametrize("version", ["5.25.0", "5.13.0", "5.12.0", "4.57.6", "5.13.0rc1"])
def test_version_outside_range_names_it_and_the_fix(monkeypatch, version):
    pytest.importorskip("packaging")
    _fake_versions(monkeypatch, transformers=version)
    line = transformers_stack.problem()
    assert line is not None and "\n" not in line
    assert f"transformers {version} is installed" in line and f"pip install 'transformers{transformers_stack.SUPPORTED}'" in line


def test_missing_transformers(monkeypatch):
    _fake_versions(monkeypatch)
    assert "transformers is not installed. Fix:" in transformers_stack.problem()


def test_leftover_kernels_named_with_its_fix(monkeypatch):
    """transformers' hub-kernels integration failing to import beside an installed kernels is blamed on kernels,
    not on a command-line value (checked for real by hand: 5.12.1 beside kernels 0.19 raises ValueError there)."""
    pytest.importorskip("packaging")
    _fake_versions(monkeypatch, transformers="5.12.1", kernels="0.19.0")
    monkeypatch.setitem(sys.modules, "transformers.integrations.hub_kernels", None)  # its import now fails
    line = transformers_stack.problem()
    assert line is not None and "\n" not in line
    assert "kernels 0.19.0" in line and line.endswith("Fix: pip uninstall -y kernels")


def test_demo_refuses_in_one_line(monkeypatch, capsys):
    from slime_ascend.demo import cli

    monkeypatch.setattr(transformers_stack, "problem", lambda: "transformers 5.25.0 is installed; Fix: x")
    assert cli.main(["--steps", "1", "--out", "unused"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: transformers 5.25.0 is installed; Fix: x"

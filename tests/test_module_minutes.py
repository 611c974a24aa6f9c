"""The minutes-per-module summary (``tests/module_minutes.py``)."""

from __future__ import annotations

import subprocess
import sys

from module_minutes import module_minutes


def test_slowest_first_in_minutes_with_the_rest_in_one_line():
    seconds = {"tests/a.py": 30.0, "tests/b.py": 180.0, "tests/c.py": 6.0, "tests/d.py": 6.0}
    assert module_minutes(seconds, most=2) == ["   3.0 min  tests/b.py", "   0.5 min  tests/a.py",
                                               "   0.2 min  (2 other modules)"]
    assert module_minutes(seconds) == ["   3.0 min  tests/b.py", "   0.5 min  tests/a.py", "   0.1 min  tests/c.py",
                                       "   0.1 min  tests/d.py"]


def test_printed_with_durations_only(tmp_path):
    (tmp_path / "conftest.py").write_text('pytest_plugins = ("module_minutes",)\n')
    (tmp_path / "test_one.py").write_text("import time\n\ndef test_a():\n    time.sleep(0.05)\n")
    (tmp_path / "test_two.py").write_text("def test_b():\n    pass\n")
    here = str(__import__("pathlib").Path(__file__).parent)

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, str(tmp_path)],
                              capture_output=True, text=True, timeout=120, env={**__import__("os").environ,
                                                                                "PYTHONPATH": here})

    with_durations = run("--durations=1").stdout
    assert "minutes per test module (total 0.0)" in with_durations, with_durations
    lines = with_durations.split("minutes per test module")[1].splitlines()[1:3]
    assert lines[0].endswith("test_one.py") and lines[1].endswith("test_two.py"), lines
    assert "minutes per test module" not in run().stdout

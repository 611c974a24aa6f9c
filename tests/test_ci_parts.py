"""CI runs the tests as two pytest processes at once (``.ci/run``): ``-m slime_loop`` (every test that runs slime's
``train.py`` / ``train_async.py``, one after another) and ``-m "not slime_loop"`` (the rest). Two slime jobs at once
could take the same port (slime numbers the ports of the engines it starts from 15000 up), so a test module that
starts a slime job and lacks the marker would make CI flaky. This checks the marker where a module starts one."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# what a test module uses to start a slime job: slime_job.run_slime (train.py / train_async.py), the e2e fixtures'
# engines for such jobs, the recipe stand-in (a recipe's run.sh); every tests/e2e/test_slime_*.py runs one
LAUNCHERS = ("run_slime(", "recipe_standin", "e2e_fixtures")


def _marked(path: Path) -> bool:
    """``slime_loop`` in the module's ``pytestmark`` or on a test function's decorators."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "slime_loop":
            return True
    return False


def test_every_module_that_starts_a_slime_job_is_marked_slime_loop():
    unmarked = []
    for path in sorted(TESTS.rglob("test_*.py")):
        text = path.read_text()
        starts = path.parent.name == "e2e" and path.name.startswith("test_slime_")
        starts = starts or any(word in text for word in LAUNCHERS)
        if starts and path != Path(__file__) and not _marked(path):
            unmarked.append(str(path.relative_to(TESTS)))
    assert not unmarked, f"these modules start slime's loop: mark them pytest.mark.slime_loop: {unmarked}"


def test_the_slime_loop_tests_are_slow_and_ci_runs_both_parts():
    """``-m "not slow"`` stays the fast local loop; .ci/run runs both marker expressions."""
    for path in sorted(TESTS.rglob("test_*.py")):
        if path != Path(__file__) and _marked(path):
            assert "mark.slow" in path.read_text(), f"{path.relative_to(TESTS)}: a slime_loop test is slow too"
    ci = (TESTS.parent / ".ci" / "run").read_text()
    assert 'run_part loop 0 "slime_loop"' in ci and 'run_part rest 5 "not slime_loop"' in ci

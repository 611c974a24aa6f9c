"""CI runs the tests as three pytest processes at once (``.ci/run``): the tests that run slime's ``train.py`` /
``train_async.py`` (marked ``slime_loop``) in two lanes of one job at a time, and ``-m "not slime_loop"`` (the rest).
A module that starts a slime job and lacks the marker would run beside other jobs in the third process. Two jobs
that start slime-managed engines at once could take the same port (slime numbers those ports from 15000 up), so
such modules are marked ``slime_managed_engines`` and .ci/run lists all of them in lane 1. This checks both."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# what a test module uses to start a slime job: slime_job.run_slime (train.py / train_async.py), the e2e fixtures'
# engines for such jobs, the recipe stand-in (a recipe's run.sh); every tests/e2e/test_slime_*.py runs one
LAUNCHERS = ("run_slime(", "recipe_standin", "e2e_fixtures")
# what starts slime-managed engines: a recipe as written (slime launches its engines), the e2e helper that turns a
# job's external engines into slime-managed ones
MANAGED = ("recipe_standin", "slime_managed(")
CI = TESTS.parent / ".ci" / "run"


def _marked(path: Path, marker: str = "slime_loop") -> bool:
    """``marker`` in the module's ``pytestmark`` or on a test function's decorators."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == marker:
            return True
    return False


def _lane1() -> set[str]:
    """The modules .ci/run's ``lane1`` lists, relative to the repository."""
    match = re.search(r'^lane1="([^"]*)"', CI.read_text(), re.M)
    assert match, ".ci/run: no lane1=\"...\" list"
    return set(match.group(1).split())


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
    ci = CI.read_text()
    assert 'run_part loop1 "slime_loop" $lane1 &' in ci and 'run_part loop2 "slime_loop" "${lane2_args[@]}" &' in ci
    assert 'run_part rest "not slime_loop" &' in ci and 'lane2_args+=("--ignore=$module")' in ci


def test_every_module_that_starts_slime_managed_engines_is_marked_and_in_lane_1():
    root = TESTS.parent
    lane1 = _lane1()
    assert all((root / module).is_file() for module in lane1), lane1
    unmarked, elsewhere = [], []
    for path in sorted(TESTS.rglob("test_*.py")):
        if path == Path(__file__):
            continue
        name = str(path.relative_to(root))
        if any(word in path.read_text() for word in MANAGED) and not _marked(path, "slime_managed_engines"):
            unmarked.append(name)
        if _marked(path, "slime_managed_engines") and name not in lane1:
            elsewhere.append(name)
    assert not unmarked, f"these modules start slime-managed engines: mark them slime_managed_engines: {unmarked}"
    assert not elsewhere, f"add these modules to lane1 in .ci/run (slime-managed engines, one at a time): {elsewhere}"

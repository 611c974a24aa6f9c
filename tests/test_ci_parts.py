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
    assert 'run_part rest "not slime_loop" ||' in ci and 'run_part loop3 "slime_loop" $lane3 ||' in ci
    assert "rest_then_lane3 &" in ci and 'for module in $lane1 $lane3; do lane2_args+=("--ignore=$module"); done' in ci
    # every part's exit status decides CI's
    assert '[ "${rcs[0]}" = 0 ] && [ "${rcs[1]}" = 0 ] && [ "${rcs[2]}" = 0 ] && [ "${rcs[3]}" = 0 ]' in ci


def _lane(name: str) -> set[str]:
    match = re.search(rf'^{name}="([^"]*)"', CI.read_text(), re.M)
    assert match, f".ci/run: no {name}=\"...\" list"
    return set(match.group(1).split())


def test_lane_3_runs_slime_loop_modules_that_start_no_slime_managed_engines():
    """Lane 3 runs beside lanes 1 and 2, so it holds no module that starts slime-managed engines, and none of lane 1."""
    root = TESTS.parent
    lane3 = _lane("lane3")
    assert lane3 and all((root / m).is_file() for m in lane3), lane3
    assert not lane3 & _lane("lane1")
    for module in lane3:
        assert _marked(root / module) and not _marked(root / module, "slime_managed_engines"), module


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


def _command_words(script: str) -> list[tuple[int, str]]:
    """(line number, first word) of every line of ``script`` on which bash starts a command: not inside a quoted
    string, not the continuation of a line ending in a backslash, not a comment; leading ``NAME=value``
    assignments skipped (``X=1 python ...`` runs python)."""
    words, in_single, in_double, continued = [], False, False, False
    for number, line in enumerate(script.splitlines(), 1):
        starts = not (in_single or in_double or continued)
        escaped, comment = False, False
        for i, char in enumerate(line):
            if escaped:
                escaped = False
            elif in_single:
                in_single = char != "'"
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_double = not in_double
            elif in_double:
                continue
            elif char == "'":
                in_single = True
            elif char == "#" and (i == 0 or line[i - 1] in " \t;"):
                comment = True
                break
        continued = line.rstrip().endswith("\\") and not comment
        if not starts:
            continue
        tokens = line.split()
        while len(tokens) > 1 and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=[^\s\"'$(]*", tokens[0]):
            tokens = tokens[1:]
        if tokens and not tokens[0].startswith("#") and not re.match(r"[A-Za-z_][A-Za-z0-9_]*\+?=", tokens[0]):
            words.append((number, tokens[0]))
    return words


def test_every_line_of_ci_run_starts_a_command_bash_has():
    """A comment line that lost its ``#`` parses, and fails only when CI reaches it ("this: command not found",
    stop 48, after the four minutes of install). Every line on which .ci/run starts a command starts with a shell
    keyword or builtin, a function the script defines, a program on PATH, or the venv's ``python``."""
    import shutil
    import subprocess
    import sys

    script = CI.read_text()
    known = set(subprocess.run(["bash", "-c", "compgen -b; compgen -k"], capture_output=True, text=True,
                               check=True).stdout.split())
    known |= set(re.findall(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\(\)\s*\{", script, re.M))
    known |= {"{", "}", "[", "]]", '"${PYTHON:-python}"', "python"}
    path = str(Path(sys.executable).parent) + ":" + __import__("os").environ.get("PATH", "")
    unknown = [(n, w) for n, w in _command_words(script)
               if w.rstrip(";").removesuffix("()") not in known and not w.startswith(("(", ")")) and shutil.which(w, path=path) is None]
    assert not unknown, f".ci/run: these lines start with no command bash knows (a comment without '#'?): {unknown}"


def test_the_command_line_check_finds_a_comment_without_its_hash():
    assert _command_words("# one\nthis round's MTP job, 1.3 min, joined lane 1); lane 2\n# two\n")[0] == (2, "this")
    script = 'a=$(mktemp -d)\nX=1 Y=2 python -V \\\n  --flag\nl="x\n  y"\nf() {  # f\n  echo "$1"\n}\n'
    assert _command_words(script) == [(2, "python"), (6, "f()"), (7, "echo"), (8, "}")]

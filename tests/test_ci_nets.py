"""The nets CI stands on (tests/ci_net.py), each proved by a pytest run on a tiny test file: under
SLIME_ASCEND_REQUIRE_SLIME=1 a skipped ``slime`` or ``slow`` test fails the run and is named; outside
CI a ``slime`` test skips, saying why, where a package of slime's stack is absent."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ci_net
import conftest

TESTS = Path(__file__).resolve().parent
INI = "[pytest]\naddopts = -p no:cacheprovider\nmarkers =\n    slime: s\n    slow: s\n"


def run_pytest(tmp_path: Path, body: str, *plugins: str, require: bool = True) -> subprocess.CompletedProcess:
    """pytest on ``body`` (test_tiny.py in ``tmp_path``, its own rootdir) with ``plugins`` loaded by -p."""
    (tmp_path / "test_tiny.py").write_text(textwrap.dedent(body))
    (tmp_path / "pytest.ini").write_text(INI)
    env = {k: v for k, v in os.environ.items() if k not in ("SLIME_ASCEND_REQUIRE_SLIME", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(TESTS), *filter(None, [env.get("PYTHONPATH")])])
    if require:
        env["SLIME_ASCEND_REQUIRE_SLIME"] = "1"
    args = [a for p in plugins for a in ("-p", p)]
    return subprocess.run([sys.executable, "-m", "pytest", *args, "-q", "-rs", "test_tiny.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


SLIME_SKIPS = """
    import pytest

    @pytest.mark.slime
    def test_needs_slime():
        pytest.skip("no slime here")

    def test_plain():
        assert 1 + 1 == 2
"""


@pytest.mark.parametrize("body, hidden", [
    (SLIME_SKIPS, ["test_tiny.py::test_needs_slime: no slime here"]),
    ("""
     import pytest

     @pytest.mark.slow
     @pytest.mark.skipif(True, reason="too slow today")
     def test_long():
         pass
     """, ["test_tiny.py::test_long: too slow today"]),
    ("""
     import pytest

     pytestmark = pytest.mark.slime

     @pytest.mark.parametrize("n", [1, 2])
     def test_each(n):
         if n == 2:
             pytest.skip("two is missing")
     """, ["test_tiny.py::test_each[2]: two is missing"]),
    ("""
     import pytest

     pytest.importorskip("no_such_module_for_the_ci_net")

     @pytest.mark.slime
     def test_never_collected():
         pass
     """, ["test_tiny.py (skipped whole at collection): could not import 'no_such_module_for_the_ci_net'"]),
    ("""
     import pytest

     @pytest.fixture(scope="module")
     def model_dir():
         pytest.importorskip("no_such_module_for_the_ci_net")

     @pytest.mark.slime
     @pytest.mark.slow
     def test_real_loop(model_dir):
         pass

     @pytest.mark.slime
     def test_same_fixture(model_dir):
         pass
     """, ["test_tiny.py::test_real_loop: could not import 'no_such_module_for_the_ci_net'",
           "test_tiny.py::test_same_fixture: could not import 'no_such_module_for_the_ci_net'"]),
], ids=["slime-marked", "slow-skipif", "module-mark-one-param", "module-skipped-at-collection",
        "fixture-skips-at-setup"])
def test_a_skipped_slime_or_slow_test_fails_the_run_naming_it(tmp_path, body, hidden):
    res = run_pytest(tmp_path, body, "ci_net")
    out = res.stdout + res.stderr
    assert res.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert f"SLIME_ASCEND_REQUIRE_SLIME=1: {len(hidden)} slime/slow test(s) skipped" in out
    lines = out.splitlines()
    for entry in hidden:
        assert any(line.startswith(entry) for line in lines), out


@pytest.mark.parametrize("body, require", [
    (SLIME_SKIPS, False),  # outside CI a skip is a skip
    ("""
     import pytest

     def test_unmarked():
         pytest.skip("needs something optional")

     @pytest.mark.slime
     def test_runs():
         assert sum(range(4)) == 6
     """, True),
    ("""
     import pytest

     @pytest.mark.slime
     @pytest.mark.xfail(reason="known", strict=True)
     def test_expected_failure():
         assert 1 == 2
     """, True),
], ids=["without-the-variable", "unmarked-skip-and-a-run-slime-test", "xfail"])
def test_runs_the_net_lets_through(tmp_path, body, require):
    res = run_pytest(tmp_path, body, "ci_net", require=require)
    assert res.returncode == pytest.ExitCode.OK, res.stdout + res.stderr
    assert "slime/slow test(s) skipped" not in res.stdout


def test_the_suites_conftest_carries_the_net(tmp_path):
    """The conftest the suite runs under (loaded here with -p): a slime test that skips fails the run where
    slime's stack is installed, and the run stops before any test where it is not."""
    res = run_pytest(tmp_path, SLIME_SKIPS, "conftest")
    out = res.stdout + res.stderr
    missing = conftest.slime_missing()
    if missing is None:
        assert res.returncode == pytest.ExitCode.TESTS_FAILED, out
        assert "test_tiny.py::test_needs_slime: no slime here" in out
    else:
        assert res.returncode == pytest.ExitCode.USAGE_ERROR, out
        assert f"SLIME_ASCEND_REQUIRE_SLIME=1 but {missing}" in out


BLOCKER = "import sys\n\nsys.modules['torch_memory_saver'] = None  # find_spec now finds nothing\n"


@pytest.mark.parametrize("require", [False, True])
def test_an_absent_slime_dependency_skips_with_the_reason_outside_ci_and_fails_on_ci(tmp_path, require):
    (tmp_path / "blocker.py").write_text(BLOCKER)
    res = run_pytest(tmp_path, SLIME_SKIPS.replace('pytest.skip("no slime here")', "pass"), "blocker", "conftest",
                     require=require)
    out = res.stdout + res.stderr
    if conftest.SLIME:
        assert "slime's dependencies are not installed: " in out and "torch_memory_saver" in out, out
        assert ci_net.INSTALL_HINT in out
    else:
        assert conftest.SLIME_REASON in out, out
    if require:
        assert res.returncode == pytest.ExitCode.USAGE_ERROR, out
        assert "passed" not in out
    else:
        assert res.returncode == pytest.ExitCode.OK, out
        assert "1 passed, 1 skipped" in out


def test_found_walks_namespace_packages_and_imports_nothing(tmp_path, monkeypatch):
    ns = tmp_path / "nsroot_for_ci_net"
    (ns / "inner").mkdir(parents=True)
    (ns / "inner" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert ci_net.absent(("nsroot_for_ci_net.inner.deep", "nsroot_for_ci_net.gone", "json", "no_such_pkg.x")) == [
        "nsroot_for_ci_net.gone", "no_such_pkg.x"]
    assert "nsroot_for_ci_net.inner" not in sys.modules
    failures = ci_net.import_failures(("json", "nsroot_for_ci_net.inner", "no_such_pkg"))
    assert failures == ["nsroot_for_ci_net.inner: RuntimeError: imported",
                        "no_such_pkg: ModuleNotFoundError: No module named 'no_such_pkg'"]


def test_an_import_failure_is_reported_with_its_cause_not_the_mask_an_earlier_one_left(tmp_path, monkeypatch):
    """As sglang_router leaves sglang half-imported where IPython is absent: the next import of the victim fails
    for another reason in this process; the report gives the error it raises alone."""
    (tmp_path / "masker_for_ci_net.py").write_text("import sys\n\nsys.modules['victim_for_ci_net'] = None\n")
    (tmp_path / "victim_for_ci_net.py").write_text("import absent_dependency_for_ci_net\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "victim_for_ci_net", raising=False)
    try:
        assert ci_net.import_failures(("masker_for_ci_net", "victim_for_ci_net")) == [
            "victim_for_ci_net: ModuleNotFoundError: No module named 'absent_dependency_for_ci_net'"]
    finally:
        sys.modules.pop("masker_for_ci_net", None)
        sys.modules.pop("victim_for_ci_net", None)


def test_the_import_check_names_the_module_and_the_fix_and_fails(tmp_path):
    (tmp_path / "broken_for_ci_net.py").write_text("import absent_dependency_for_ci_net\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    res = subprocess.run([sys.executable, str(TESTS / "ci_net.py"), "json", "broken_for_ci_net"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert res.returncode == 1, res.stderr
    assert res.stderr.splitlines()[-2:] == [
        "CI: does not import: broken_for_ci_net: ModuleNotFoundError: No module named 'absent_dependency_for_ci_net'",
        f"CI: slime or its dependencies do not import ({ci_net.INSTALL_HINT})"]


def test_each_allowed_skip_names_a_real_test_and_its_reason():
    for prefix, text, why in ci_net.ALLOWED_SKIPS:
        path, _, name = prefix.partition("::")
        source = (TESTS.parent / path).read_text()
        assert text in source and why, prefix
        assert not name or f"def {name.partition('[')[0]}(" in source, prefix
    cuda = "tests/accelerator/test_npu_accelerator.py::TestOnCuda::test_device"
    assert ci_net.allowed(cuda, "needs a CUDA device (the class over torch.cuda)")
    assert not ci_net.allowed(cuda, "something else went wrong")
    # the x86-64-v3 / v4 e4m3 cases run now (boundary-dense, seconds): their skip is no longer allowed
    assert not ci_net.allowed("tests/quant/test_quant_native_targets.py::test_e4m3_rounding_near_every_boundary_and_on_"
                              "a_random_sample[x86-64-v3]", "swept by test_quant_native")
    assert not ci_net.allowed("tests/slime/test_x.py::test_y", "needs a CUDA device (the class over torch.cuda)")


SKIPPER = """
import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    pytest.skip("made to skip at run time")
"""


def test_a_real_loop_test_made_to_skip_at_run_time_fails_the_suites_run(tmp_path):
    """One of slime's real-loop runs (tests/e2e), under the suite's own conftest and CI's variable, made to skip
    as it starts (a plugin skips it in setup, before any fixture): the run fails and names it."""
    (tmp_path / "skipper.py").write_text(SKIPPER)
    target = "tests/e2e/test_slime_demo_glm5.py::test_demo_runs_its_plugins_on_slimes_glm5_spec"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env.update(SLIME_ASCEND_REQUIRE_SLIME="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])]))
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "skipper", "-q", "-rs", target], cwd=TESTS.parent,
                         env=env, capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    missing = conftest.slime_missing()
    if missing is None:
        assert res.returncode == pytest.ExitCode.TESTS_FAILED, out
        assert "SLIME_ASCEND_REQUIRE_SLIME=1: 1 slime/slow test(s) skipped" in out
        assert f"{target}: made to skip at run time" in out.splitlines(), out
    else:  # where slime's stack is absent CI's variable stops the run before any test
        assert res.returncode == pytest.ExitCode.USAGE_ERROR, out
        assert f"SLIME_ASCEND_REQUIRE_SLIME=1 but {missing}" in out


NEEDS = """
from conftest import need


def test_absent():
    need("no_such_module_for_the_ci_net", "an optional reader")


def test_broken():
    need("broken_for_the_ci_net")


def test_present():
    assert need("json").dumps([1]) == "[1]"
"""


@pytest.mark.parametrize("require", [False, True])
def test_need_skips_on_absence_outside_ci_fails_on_ci_and_never_hides_a_broken_import(tmp_path, require):
    (tmp_path / "broken_for_the_ci_net.py").write_text("import absent_dependency_for_ci_net\n")
    res = run_pytest(tmp_path, NEEDS, "conftest", require=require)
    out = res.stdout + res.stderr
    if require and conftest.slime_missing() is not None:
        assert res.returncode == pytest.ExitCode.USAGE_ERROR, out
        return
    assert res.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert "_ test_broken _" in out and "ModuleNotFoundError: No module named 'absent_dependency_for_ci_net'" in out
    reason = "no_such_module_for_the_ci_net is not installed (an optional reader)"
    if require:
        assert "_ test_absent _" in out and f"SLIME_ASCEND_REQUIRE_SLIME=1 but {reason}" in out, out
        assert "2 failed, 1 passed in" in out, out
    else:
        assert any(line.startswith("SKIPPED [1] ") and line.endswith(f": {reason}") for line in out.splitlines()), out
        assert "1 failed, 1 passed, 1 skipped in" in out, out


def test_need_gives_slimes_own_modules_the_reason_the_slime_tests_skip_with(tmp_path, monkeypatch):
    monkeypatch.setattr(conftest, "REQUIRE", False)
    monkeypatch.setattr(conftest, "slime_missing", lambda: "slime's dependencies are not installed: megatron")
    with pytest.raises(pytest.skip.Exception, match="^slime's dependencies are not installed: megatron$"):
        conftest.need("slime.utils.types")
    monkeypatch.setattr(conftest, "REQUIRE", True)
    with pytest.raises(pytest.fail.Exception, match="^SLIME_ASCEND_REQUIRE_SLIME=1 but slime's dependencies"):
        conftest.need("slime.utils.types")

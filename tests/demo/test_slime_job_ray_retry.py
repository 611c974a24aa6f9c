"""``slime_job.run_slime`` starts a job once more when Ray's local cluster did not start (Ray gives its raylet a
fixed 30 s, which a loaded 2-core host can miss before any of the job ran; seen in a CI replica with three test
processes), and only then. A stand-in ``train.py`` (``src``) plays slime's start; no Ray, no slime."""

from __future__ import annotations

import pytest

from slime_ascend.demo import slime_job

# it calls run_slime (the CI-parts check wants the marker), with a stand-in script of a second
pytestmark = [pytest.mark.slow, pytest.mark.slime_loop]

TIMEOUT_LOG = """[2026-12-06 21:52:35] placement_group.py:125 - Creating placement group with 4 GPUs...
2026-12-06 21:53:17,090	INFO node.py:438 -- Failed to get node info b'RPC error: Deadline Exceeded'
Exception: The current node timed out during startup. This could happen because some of the raylet failed to \
startup or the GCS has become overloaded.
"""

STANDIN = """import pathlib, sys
runs = pathlib.Path(sys.argv[0]).with_name("runs")
n = int(runs.read_text()) + 1 if runs.exists() else 1
runs.write_text(str(n))
failures = int(pathlib.Path(sys.argv[0]).with_name("failures").read_text())
if n <= failures:
    sys.stdout.write({log!r})
    sys.exit(1)
print("job ran")
"""


def _standin(tmp_path, failures: int, log: str = TIMEOUT_LOG):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text(STANDIN.format(log=log))
    (src / "failures").write_text(str(failures))
    work = tmp_path / "work"
    work.mkdir()
    return src, work


def test_a_job_whose_ray_start_timed_out_starts_once_more(tmp_path, capsys):
    src, work = _standin(tmp_path, failures=1)
    run = slime_job.run_slime("train.py", [], work, ("cpu",), src=src, timeout=60)
    assert run.returncode == 0 and "job ran" in run.log
    assert (src / "runs").read_text() == "2"
    assert "did not start within Ray's fixed 30 s" in capsys.readouterr().err
    assert (work / "train.ray-start-timeout.log").read_text() == TIMEOUT_LOG  # the first try's log is kept


def test_only_once_and_only_for_rays_start(tmp_path):
    src, work = _standin(tmp_path, failures=5)
    run = slime_job.run_slime("train.py", [], work, ("cpu",), src=src, timeout=60)
    assert run.returncode == 1 and (src / "runs").read_text() == "2"
    other = tmp_path / "other"
    other.mkdir()
    src, work = _standin(other, failures=1, log="Creating placement group with 1 GPUs...\nValueError: bad flag\n")
    run = slime_job.run_slime("train.py", [], work, ("cpu",), src=src, timeout=60)
    assert run.returncode == 1 and (src / "runs").read_text() == "1"


def test_a_timeout_after_the_actors_started_is_the_jobs_own_failure():
    assert slime_job.ray_start_timed_out(TIMEOUT_LOG)
    assert not slime_job.ray_start_timed_out(TIMEOUT_LOG + "(MegatronTrainRayActor pid=1) up\n")
    assert not slime_job.ray_start_timed_out("Creating placement group with 4 GPUs...\n")

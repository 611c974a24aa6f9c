"""``slime-ascend demo --slime-src DIR``: the demo's default plugins in slime's own ``train_async.py``, with the
``verifier-gate`` plugin checking the job's verifiers at slime's ``parse_args``.

The command is run as a user runs it; the assertions read what it wrote (``summary.json``,
``metrics.jsonl``, ``curves.png``), which the demo takes from slime's own logged metrics and log.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from slime_ascend.demo.loop import DEFAULT_PLUGINS
from slime_ascend.demo.slime_job import job_env, slime_src

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.timeout(1800)]

STEPS = 2


def test_demo_in_slime_loop(tmp_path):
    src = slime_src()
    out = tmp_path / "demo"
    env = job_env(())
    env.pop("SLIME_ASCEND_PLUGINS")
    proc = subprocess.run([sys.executable, "-m", "slime_ascend.cli", "demo", "--slime-src", str(src), "--steps",
                           str(STEPS), "--batch", "8", "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=1700)
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert summary["loop"] == "slime" and summary["returncode"] == 0
    assert summary["plugins"] == ["cpu", *DEFAULT_PLUGINS, "verifier-gate"]
    assert summary["steps_done"] == STEPS
    assert summary["plugins_without_evidence"] == [], summary["evidence"]
    evidence = summary["evidence"]
    k = yaml.safe_load((out / "ascend.yaml").read_text())["ascend_sao_critic_iters"]
    # JSON keys are strings: rollout id -> critic updates slime logged for it
    assert evidence["sao"]["critic_passes_per_rollout"] == {str(i): k for i in range(STEPS)}
    assert any("(int8" in line for line in evidence["int8-sync"]["log"])  # the engine served int8 versions
    assert max(evidence["compaction"]["metrics"]["rollout/round_number"]) > 0  # later segments were trained
    assert sum(evidence["opd"]["metrics"]["rollout/opd_pool/switches"]) >= 1
    # the verifier gate ran in slime's processes at parse_args, over the verifiers the job trains with
    assert evidence["verifier-gate"]["log"] and all("passes oracle, no_action and unfinished" in line
                                                     for line in evidence["verifier-gate"]["log"]), evidence
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["reward"] is not None and "train/step" in r["slime"] for r in rows)
    assert (out / "curves.png").stat().st_size > 0
    # one echoed line per rollout, from slime's metrics as they appeared
    assert sum(line.startswith("rollout ") for line in proc.stdout.splitlines()) == STEPS

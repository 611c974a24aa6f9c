"""Faults inside slime's own loop: stock ``train.py`` on this CPU (``cpu`` plugin), torch engines behind slime's
router, each fault injected at a known request by :mod:`fault_proxy` (a loopback proxy in front of an
engine), never by timing.

Evidence comes from slime's own output (exit code, its log, the step metrics it prints, the rollout data
it dumps with ``--save-debug-rollout-data``), the engines' own answers, and the proxies' request counts.

slime's ``--use-fault-tolerance`` (a health monitor that kills an engine's Ray actor and restarts it before
the next weight update) does not apply to ``--rollout-external`` engines: slime neither restarts them nor
takes them off its router (``SGLangEngine.shutdown`` returns at once for external engines), so these runs
go without it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from fault_proxy import FaultProxy
from slime_ascend.demo.slime_job import (make_prompts, parse_rollout_metrics, run_slime, slime_flags,
                                     start_engines, stop)
from e2e_fixtures import model_dir  # noqa: F401  (pytest fixture)

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.timeout(1200)]


def _config(tmp_path: Path, *plugins: str, settings: dict[str, object] | None = None) -> Path:
    out = tmp_path / "ascend.yaml"
    sets = [a for k, v in (settings or {}).items() for a in ("--set", f"{k}={v}")]
    subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", *plugins, *sets, "-o", str(out)], check=True,
                   capture_output=True, text=True)
    return out


def _with_load(flags: list[str], ckpt: Path) -> list[str]:
    """``flags`` with ``--load`` of ``ckpt`` (a job restarted from its own ``--save`` directory)."""
    flags = list(flags)
    flags[flags.index("--load") + 1] = str(ckpt)
    return flags


def _info(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/get_server_info", timeout=10).read())


def _dumped_samples(path: Path) -> list[dict]:
    import torch

    return torch.load(path, weights_only=False)["samples"]


def test_an_engine_killed_mid_rollout_an_engine_silent_on_a_weight_update_and_the_job_resumed(model_dir, tmp_path):
    """Three engines behind slime's router (round robin), a job of two rollouts of 2 prompts x 2 samples, saved
    after every step (``--save-interval 1``).

    * engine 1 is killed by its proxy at its first ``/generate`` (during rollout 0): the rollout completes on
      engines 0 and 2 (slime's router and its generate retries), every sample once, none trained twice;
    * engine 2 never answers the second weight update (version 2, after train step 0 and its save): the switch
      waits ``ascend_weight_update_deadline_s`` (10 s here) for it, sends engine 0 back to version 1 and resumes
      it, leaves engines 1 and 2 unacknowledged, and slime stops with one line naming both;
    * the stopped job is started again as it was, on engine 0 alone, with ``--load`` of its ``--save``
      directory: it resumes at rollout 1 (the saved step 0's Megatron checkpoint, optimizer included, and
      slime's data-source position), pushes the saved weights as version 2 and its step's as version 3 (the
      versions the uninterrupted job gave them), trains rollout 1's new samples once, and keeps the saved
      step's checkpoint."""
    plugins = ("cpu", "staleness")
    deadline_s = 10
    # started together, still loading while slime starts (slime's server-info query through the proxies waits)
    engines = start_engines([model_dir] * 3, [tmp_path / f"engine{i}.log" for i in range(3)], ready=False)
    proxies = [FaultProxy(engines[0].url),
               FaultProxy(engines[1].url, engines[1].proc.pid, kill_at=("/generate", 1)),
               FaultProxy(engines[2].url, hold_at=("/update_weights_from_disk", 2))]
    batch, n_samples = 2, 2
    prompts = make_prompts(tmp_path / "prompts.jsonl")
    job = ["--save-interval", "1", "--save-debug-rollout-data", str(tmp_path / "dump" / "rollout_{rollout_id}.pt")]
    ckpt = tmp_path / "ckpt"  # slime_flags' --save
    try:
        flags = slime_flags(model_dir, prompts, proxies, tmp_path, num_rollout=2, batch=batch,
                            n_samples=n_samples) + job + ["--router-policy", "round_robin"]
        config = _config(tmp_path, *plugins, settings={"ascend_weight_update_deadline_s": deadline_s})
        run = run_slime("train.py", flags, tmp_path, plugins, custom_config=config, timeout=600)
        after = [_info(engines[0].url), _info(engines[2].url)]
        saved = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
        # the same job again, on the engine left serving, from its own checkpoint
        resumed_flags = _with_load(slime_flags(model_dir, prompts, [engines[0]], tmp_path, num_rollout=2, batch=batch,
                                               n_samples=n_samples) + job, ckpt)
        resumed = run_slime("train.py", resumed_flags, tmp_path, plugins, custom_config=config, timeout=600)
        final = _info(engines[0].url)
    finally:
        for proxy in proxies:
            proxy.close()
        for eng in engines:
            stop(eng.proc)
    assert run.returncode != 0, run.log[-3000:]
    assert "weight version 1 acknowledged by every engine (3)" in run.log, run.log[-5000:]

    # -- the killed engine: rollout 0 completed on the two others, each sample generated and trained once
    assert proxies[1].killed.is_set() and engines[1].proc.poll() is not None
    assert proxies[1].answered["/generate"] == 0
    samples = _dumped_samples(tmp_path / "dump" / "rollout_0.pt")
    assert len(samples) == batch * n_samples, len(samples)
    assert sorted(s["index"] for s in samples) == list(range(batch * n_samples)), [s["index"] for s in samples]
    assert all(s["status"] in ("completed", "truncated") and s["response_length"] > 0 for s in samples), \
        [(s["status"], s["response_length"]) for s in samples]
    # exactly one answered /generate per sample across the fleet: none lost, none generated twice
    assert proxies[0].answered["/generate"] + proxies[2].answered["/generate"] == batch * n_samples
    assert [m["train/step"] for m in run.metrics() if "train/step" in m] == [0]  # the one step, trained once

    # -- the silent engine: a deadline, not a hang; the one line names both engines and what became of them
    assert proxies[2].held.is_set()
    line = re.search(r"weight version 2 was not taken by every engine \(engine 1: pause_generation: [^;\n]*; "
                     rf"engine 2: no answer to update_weights_from_disk within {deadline_s} s\); engine 0 back on "
                     r"version 1 and generating; engines 1, 2 did not answer and are not acknowledged on any "
                     r"version\. Fix: restart engines 1, 2", run.log)
    assert line, run.log[-5000:]
    assert "weight version 2 acknowledged" not in run.log
    # engine 0 loaded version 2, was sent back to version 1 (kept for it) and resumed; engine 2 never saw the load
    assert after[0]["weight_version"] == "1" and not after[0]["paused"], after[0]
    assert after[1]["weight_version"] == "1", after[1]
    assert "loaded weight version 2 from" in engines[0].log.read_text()
    assert "loaded weight version 2 from" not in engines[2].log.read_text()
    assert run.seconds < 420, run.seconds  # bounded: no wait for ever
    assert saved == "0"  # the stopped job's step 0 was saved before the push that failed

    # -- the job resumed with --load: rollout 1 on, its versions the uninterrupted job's, nothing trained twice
    assert resumed.returncode == 0, resumed.log[-5000:]
    assert "resumed at rollout 1 (train.py): weight versions go on after 1 (the next push is version 2)" in resumed.log
    assert "weight version 2 acknowledged by every engine (1)" in resumed.log, resumed.log[-5000:]
    assert "weight version 3 acknowledged by every engine (1)" in resumed.log, resumed.log[-5000:]
    assert "weight version 1 acknowledged" not in resumed.log  # no version goes back
    assert final["weight_version"] == "3" and not final["paused"], final
    assert [m["train/step"] for m in resumed.metrics() if "train/step" in m] == [1]  # step 1, once
    assert sorted(parse_rollout_metrics(resumed.log)) == [1], sorted(parse_rollout_metrics(resumed.log))
    again = _dumped_samples(tmp_path / "dump" / "rollout_1.pt")
    assert sorted(s["index"] for s in again) == list(range(batch * n_samples, 2 * batch * n_samples))
    assert not {str(s["prompt"]) for s in again} & {str(s["prompt"]) for s in samples}  # the next prompts, not rollout 0's
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (ckpt / "iter_0000000").is_dir() and (ckpt / "iter_0000001").is_dir()  # the saved step kept


def test_a_teacher_engine_dying_mid_opd_fails_its_samples_as_environment_failures(model_dir, tmp_path):
    """``opd`` with one URL teacher behind a proxy that kills the teacher engine at its 3rd scoring request
    (after the first 2 are answered), no retries: the 2 samples it never scored are FAILED and removed
    (``metadata["opd_failure"]`` says why), not trained with a zero reward; the 2 it scored train as usual,
    and the step completes."""
    import yaml

    from slime_ascend.demo.slime_job import make_model

    plugins = ("cpu", "opd")
    batch, n_samples = 2, 2
    teacher_dir = make_model(tmp_path / "teacher", seed=1)
    rollout, teacher = start_engines([model_dir, teacher_dir], [tmp_path / "engine-rollout.log",
                                                                tmp_path / "engine-teacher.log"], ready=False)
    proxy = FaultProxy(teacher.url, teacher.proc.pid, kill_at=("/generate", 3))
    try:
        config = tmp_path / "ascend.yaml"
        subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", *plugins, "-o", str(config)], check=True,
                       capture_output=True, text=True)
        cfg = yaml.safe_load(config.read_text())
        cfg.update({"ascend_opd_teachers": [{"name": "math", "checkpoint_dir": str(teacher_dir), "domains": ["math"],
                                             "url": proxy.url}],
                    "ascend_opd_request_retries": 0, "ascend_opd_request_timeout_s": 60,
                    "ascend_opd_task_rm_path": "slime_ascend.opd.hooks.slime_rule_reward"})
        config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        prompts = make_prompts(tmp_path / "prompts.jsonl", domains=("math",))
        flags = slime_flags(model_dir, prompts, [rollout], tmp_path, num_rollout=1, batch=batch, n_samples=n_samples)
        flags += ["--save-debug-rollout-data", str(tmp_path / "dump" / "rollout_{rollout_id}.pt")]
        run = run_slime("train.py", flags, tmp_path, plugins, custom_config=config, timeout=600)
    finally:
        proxy.close()
        stop(teacher.proc)
        stop(rollout.proc)
    assert run.returncode == 0, run.log[-5000:]
    assert proxy.killed.is_set() and proxy.answered["/generate"] == 2 and proxy.seen["/generate"] >= 3
    samples = _dumped_samples(tmp_path / "dump" / "rollout_0.pt")
    assert len(samples) == batch * n_samples
    failed = [s for s in samples if s["status"] == "failed"]
    scored = [s for s in samples if s["status"] != "failed"]
    assert len(failed) == 2 and len(scored) == 2, [(s["status"], s["metadata"].get("opd_failure")) for s in samples]
    for s in failed:  # an environment failure: removed from training, the reason kept
        assert s["remove_sample"] is True and "opd_teacher_log_probs" not in s["metadata"]
        assert s["metadata"]["opd_failure"].startswith("teacher 'math' did not score it: request to "), s["metadata"]
    for s in scored:
        assert not s.get("remove_sample") and "opd_failure" not in s["metadata"]
        assert len(s["metadata"]["opd_teacher_log_probs"]) == s["response_length"]  # scored by the teacher
    opd = [m for m in run.metrics() if "rollout/opd_failed_samples" in m]
    assert [m["rollout/opd_failed_samples"] for m in opd] == [2], opd
    assert run.log.count("failed as an environment failure (teacher 'math' did not score it") == 2
    assert [m["train/step"] for m in run.metrics() if "train/step" in m] == [0]

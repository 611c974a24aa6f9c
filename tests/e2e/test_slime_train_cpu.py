"""slime's own ``train.py`` and ``train_async.py`` on this CPU with the ``cpu`` plugin.

Each test runs stock slime from ``SLIME_SRC`` (RayTrainGroup, RolloutManager, slime's sglang router,
a Megatron train actor, disk weight updates) against the torch engine on 127.0.0.1, and reads
its evidence from slime's own output: exit code, the step metrics slime logs, the weight versions it
writes. Reward is slime's ``--rm-type random``, so the policy gradient is not identically zero.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from slime_ascend.demo.slime_job import make_prompts, run_slime, slime_flags
from e2e_fixtures import engine, model_dir  # noqa: F401  (pytest fixtures)

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.timeout(1200)]


def _config(tmp_path: Path, *plugins: str, settings: dict[str, object] | None = None) -> Path:
    out = tmp_path / "ascend.yaml"
    sets = [a for k, v in (settings or {}).items() for a in ("--set", f"{k}={v}")]
    subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", *plugins, *sets, "-o", str(out)], check=True,
                   capture_output=True, text=True)
    return out


def _rollout_reports(run, name: str) -> list[dict]:
    """The counts a rollout-side plugin reported on slime's rollout metric path, one dict per rollout."""
    return [m for m in run.metrics() if any(k.startswith(f"rollout/{name}_") for k in m)]


def _steps(run, key: str) -> list[dict]:
    return [m for m in run.metrics() if key in m]


def _groups_ahead(run, rollout_id: int) -> int:
    """How many groups slime's fully-async worker had finished ahead when ``slow_trainer_rollout`` handed
    rollout ``rollout_id`` back (the line it prints in the RolloutManager: its ``AHEAD_LINE``)."""
    pattern = rf"groups finished ahead of the weight update after rollout {rollout_id}: (\d+)"
    found = [int(m.group(1)) for m in re.finditer(pattern, run.log)]
    assert len(found) == 1, (found, run.log[-4000:])
    return found[0]


def _assert_finished(run):
    assert run.returncode == 0, run.log[-6000:]


def test_train_async_py_fully_async_grpo_with_icepop_staleness_and_tito(model_dir, engine, tmp_path):
    """IcePop masks and staleness drops in slime's own asynchronous loop.

    slime's fully-async rollout worker keeps a pool of ``--sglang-server-concurrency`` groups generating
    ahead of the trainer, and stops topping it up once that many finished groups wait. With a pool of 2 for 4
    groups a rollout, the groups the worker finishes before the weight update (2, or 3 when one finished
    while another ran: the worker's timing, which ``slow_trainer_rollout`` prints) are of the old weights;
    the next rollout takes them first and generates the rest after the update. With
    ``ascend_staleness_tau: 0`` the old ones lag the newest version seen by 1, so they are stale and
    dropped. slime's worker runs through ``slow_trainer_rollout``, which waits for the worker to be at rest
    (every group it took finished) before the rollout returns (a real trainer is the slow side; on a busy
    2-core host the update could otherwise overtake them, and nothing would be stale). IcePop's band is tight ([1/1.0001, 1.0001])
    so that the Megatron-bf16 vs engine-fp32 log-prob gap (about 1e-3) masks tokens: its mask visibly acts.
    """
    plugins = ("cpu", "icepop", "staleness", "tito")
    prompts = make_prompts(tmp_path / "prompts.jsonl")
    batch, n_samples, num_rollout = 4, 2, 3
    flags = slime_flags(model_dir, prompts, [engine], tmp_path, num_rollout=num_rollout, batch=batch,
                        n_samples=n_samples, save=False) + [
        "--rollout-function-path", "slow_trainer_rollout.generate_rollout", "--sglang-server-concurrency", "2"]
    config = _config(tmp_path, *plugins, settings={"ascend_staleness_tau": 0, "ascend_icepop_beta": 1.0001})
    run = run_slime("train_async.py", flags, tmp_path, plugins, custom_config=config,
                    extra_env={"PYTHONPATH": str(Path(__file__).parent)})
    _assert_finished(run)
    for role in ("RolloutManager", "MegatronTrainRayActor"):
        assert any(role in line and "slime-ascend plugins active: cpu, icepop, staleness, tito" in line
                   for line in run.log.splitlines()), role
    assert "backend=gloo" in run.log  # the cpu accelerator's process group
    train_steps = _steps(run, "train/step")
    assert [m["train/step"] for m in train_steps] == list(range(num_rollout))
    # IcePop measured and masked the train/rollout ratio on every step, inside slime's policy loss
    for m in train_steps:
        assert 0.0 <= m["train/icepop_masked"] <= 1.0 and "train/icepop_ratio" in m, m
    assert any(m["train/icepop_masked"] > 0 for m in train_steps), train_steps
    # staleness judged every rollout and dropped the groups generated before the last weight update
    staleness = _rollout_reports(run, "staleness")
    assert len(staleness) == num_rollout, staleness
    assert all(m["rollout/staleness_rollouts"] == batch * n_samples for m in staleness), staleness
    # rollouts 0 and 1 are all of weights v1 (train_async.py generates rollout 1 before the first update);
    # rollout 2 takes the groups finished ahead with v1, then generates the rest with v2: those go
    ahead = _groups_ahead(run, rollout_id=1)
    assert ahead in (2, 3), ahead  # a pool of 2, topped up once a second
    assert [m["rollout/staleness_trainer_version"] for m in staleness] == [1, 1, 2], staleness
    assert [m["rollout/staleness_stale"] for m in staleness] == [0, 0, ahead * n_samples], staleness
    assert [m["rollout/staleness_dropped_groups"] for m in staleness] == [0, 0, ahead], staleness
    for m in staleness:
        assert m["rollout/staleness_dropped"] == m["rollout/staleness_rollouts"] - m["rollout/staleness_kept"] \
            - m["rollout/staleness_padded"], m
        assert m["rollout/staleness_stale"] == 0 or m["rollout/staleness_max_lag"] >= 1, m
    assert "staleness: trainer version" in run.log  # the plugin's own account of what it dropped and why
    tito = _rollout_reports(run, "tito")
    assert [m["rollout/tito_checked_samples"] for m in tito] == [batch * n_samples] * num_rollout, tito
    # ... and in slime's trackers: IcePop's masked fraction per train step, the staleness drops per rollout
    tracked = run.tracked()
    assert [step for step, _ in tracked["train/icepop_masked"]] == list(range(num_rollout))
    assert [v for _, v in tracked["rollout/staleness_dropped"]] == [0, 0, ahead * n_samples]


def test_a_weight_update_one_engine_refuses_leaves_every_engine_on_the_old_version(model_dir, engine, tmp_path):
    """Two rollout engines; the second serves a model of another shape, so it refuses slime's first weight
    push. The switch is all or none: the first engine, which loaded version 1, is returned to the version it
    served before (its start checkpoint), generation resumes, and slime stops with one line naming the
    engine, instead of training against a fleet that serves two versions."""
    import json
    import urllib.request

    from transformers import AutoModelForCausalLM

    from slime_ascend.demo.slime_job import start_engine, stop
    from slime_ascend.rollout.torch_engine.model import build_byte_tokenizer, save_model, tiny_qwen3_config

    config = tiny_qwen3_config()
    config.intermediate_size = 96  # another shape: version 1 cannot load into it
    other = tmp_path / "other-shape"
    save_model(AutoModelForCausalLM.from_config(config).eval(), other, build_byte_tokenizer())
    second = start_engine(other, tmp_path / "engine-other.log", ready=False)
    try:
        plugins = ("cpu", "staleness")
        prompts = make_prompts(tmp_path / "prompts.jsonl")
        run = run_slime("train.py", slime_flags(model_dir, prompts, [engine, second], tmp_path, num_rollout=1),
                        tmp_path, plugins, custom_config=_config(tmp_path, *plugins))
        first_info = json.loads(urllib.request.urlopen(engine.url + "/get_model_info", timeout=10).read())
    finally:
        stop(second.proc)
    assert run.returncode != 0, run.log[-3000:]
    assert re.search(r"weight version 1 was not taken by every engine \(engine 1: [^\n]*\); every engine is back "
                     r"on version default\. Fix: look at that engine's log", run.log), run.log[-5000:]
    # the first engine loaded version 1, then went back to the checkpoint it started on
    assert first_info["weight_version"] == "default" and first_info["model_path"] == str(model_dir), first_info
    first_log = engine.log.read_text()
    assert "loaded weight version 1 from" in first_log and f"loaded weight version default from {model_dir}" in first_log
    assert "train/step" not in run.log  # nothing trained against a split fleet



def test_train_py_on_a_two_cpu_ray_stops_in_parse_args_naming_the_override(model_dir, engine, tmp_path):
    """The job of docs/cpu.md ('Your own job') on a host where Ray would advertise 2 logical CPUs (a 2-core host
    without RAY_OVERRIDE_RESOURCES; pinned here so a bigger host sees the same): slime's actors need 3.2, and train.py
    used to wait for ever. It now stops in the driver's parse_args with one line, before Ray starts."""
    plugins = ("cpu", "dis")
    prompts = make_prompts(tmp_path / "prompts.jsonl")
    run = run_slime("train.py", slime_flags(model_dir, prompts, [engine], tmp_path, num_rollout=1), tmp_path, plugins,
                    custom_config=_config(tmp_path, *plugins), extra_env={"RAY_OVERRIDE_RESOURCES": '{"CPU": 2}'},
                    timeout=300)
    assert run.returncode == 2, run.log[-4000:]
    errors = [line for line in run.log.splitlines() if line.startswith("slime-ascend: error:")]
    assert len(errors) == 1, run.log[-4000:]
    assert "with 2 logical CPUs, but slime asks for 3.2" in errors[0]
    assert "Fix: export RAY_OVERRIDE_RESOURCES='{\"CPU\": 8}'" in errors[0]
    assert "Started a local Ray instance" not in run.log and "Traceback" not in run.log

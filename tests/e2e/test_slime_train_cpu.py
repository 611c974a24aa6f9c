"""slime's own ``train.py`` and ``train_async.py`` on this CPU with the ``cpu`` plugin.

Each test runs stock slime from ``SLIME_SRC`` (RayTrainGroup, RolloutManager, slime's sglang router,
a Megatron train actor, disk weight updates) against the reference engine on 127.0.0.1, and reads
its evidence from slime's own output: exit code, the step metrics slime logs, the weight versions it
writes. Reward is slime's ``--rm-type random``, so the policy gradient is not identically zero.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slime_ascend.demo.slime_job import make_model, make_prompts, run_slime, slime_flags, start_engine, stop

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    pytest.importorskip("megatron.training", reason="megatron-core with megatron.training is not installed")
    pytest.importorskip("sglang_router", reason="sglang-router is not installed")
    return make_model(tmp_path_factory.mktemp("model") / "tiny-qwen3")


@pytest.fixture
def engine(model_dir, tmp_path):
    eng = start_engine(model_dir, tmp_path / "engine.log")
    yield eng
    stop(eng.proc)


def _config(tmp_path: Path, *plugins: str) -> Path:
    out = tmp_path / "ascend.yaml"
    subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", *plugins, "-o", str(out)], check=True,
                   capture_output=True, text=True)
    return out


def _steps(run, key: str) -> list[dict]:
    return [m for m in run.metrics() if key in m]


def _assert_finished(run):
    assert run.returncode == 0, run.log[-6000:]


def test_train_py_grpo_with_dis_and_staleness(model_dir, engine, tmp_path):
    plugins = ("cpu", "dis", "staleness")
    prompts = make_prompts(tmp_path / "prompts.jsonl")
    run = run_slime("train.py", slime_flags(model_dir, prompts, [engine], tmp_path, num_rollout=2, n_samples=4),
                    tmp_path, plugins, custom_config=_config(tmp_path, *plugins))
    _assert_finished(run)
    # every role ran the plugins, from the bootstrap and the YAML slime loaded
    for role in ("RolloutManager", "MegatronTrainRayActor"):
        assert any(role in line and "slime-ascend plugins active: cpu, dis, staleness" in line
                   for line in run.log.splitlines()), role
    for patch_id in ("driver.ray_cpu_resources", "train.cpu_current_device", "train.cpu_streams",
                     "train.cpu_device_map", "train.cpu_tensor_type"):
        assert f"applied runtime patch {patch_id}" in run.log
    train_steps = _steps(run, "train/step")
    assert [m["train/step"] for m in train_steps] == [0, 1]
    # DIS measured the train/rollout ratio on every step, inside slime's policy loss
    assert all(any(k.startswith("train/dis_") for k in m) for m in train_steps), train_steps
    # training saw real gradients (random 0/1 rewards: a step whose every group drew equal rewards has
    # zero GRPO advantages, so not every step must) and the train/rollout log-prob gap stays small
    # (Megatron bf16 vs the engine's fp32)
    assert any(m["train/grad_norm"] > 0 for m in train_steps), train_steps
    assert all(m["train/train_rollout_logprob_abs_diff"] < 0.05 for m in train_steps)
    # the weights slime pushed after each step were written for the engine's update_weights_from_disk
    versions = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert len(versions) >= 2, versions
    assert _steps(run, "perf/update_weights_time")


def test_train_async_py(model_dir, engine, tmp_path):
    plugins = ("cpu",)
    prompts = make_prompts(tmp_path / "prompts.jsonl")
    run = run_slime("train_async.py", slime_flags(model_dir, prompts, [engine], tmp_path, num_rollout=2),
                    tmp_path, plugins)
    _assert_finished(run)
    assert [m["train/step"] for m in _steps(run, "train/step")] == [0, 1]
    rollout = _steps(run, "rollout/raw_reward")
    assert rollout, "slime logged no rollout metrics"
    assert "cpu" in run.log and "backend=gloo" in run.log

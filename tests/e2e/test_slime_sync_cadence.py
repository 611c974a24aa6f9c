"""``sync-cadence`` in slime's own ``train_async.py`` on this CPU: weights pushed every 2 updates
(``--update-weights-interval 2``), the optimizer reset after each push and not between."""

from __future__ import annotations

import re

import pytest

from slime_ascend.demo.slime_job import make_prompts, run_slime, slime_flags
from e2e_fixtures import engine, model_dir  # noqa: F401  (pytest fixtures)

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.timeout(1200)]


def test_train_async_py_pushes_every_two_updates_and_resets_the_optimizer_after_each(model_dir, engine, tmp_path):
    import subprocess
    import sys

    plugins = ("cpu", "sync-cadence")
    config = tmp_path / "ascend.yaml"
    subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", *plugins, "-o", str(config)], check=True,
                   capture_output=True, text=True)
    num_rollout = 4
    flags = slime_flags(model_dir, make_prompts(tmp_path / "prompts.jsonl"), [engine], tmp_path,
                        num_rollout=num_rollout) + ["--update-weights-interval", "2", "--update-weight-disk-keep-files"]
    run = run_slime("train_async.py", flags, tmp_path, plugins, custom_config=config)
    assert run.returncode == 0, run.log[-6000:]
    steps = sorted({int(m["train/step"]) for m in run.metrics("train/") if "train/step" in m})
    assert steps == list(range(num_rollout)), steps
    # slime pushed before training (version 1) and after updates 2 and 4 (versions 2, 3) ...
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [
        "weight_v000001", "weight_v000002", "weight_v000003"]
    # ... and the optimizer was reset once after each push, before the next training: push 1 (nothing trained
    # yet) before rollout 0, push 2 before rollout 2, not between (rollouts 1 and 3 keep their moments);
    # push 3 came after the last training
    resets = re.findall(r"sync-cadence: optimizer states reset after weight push (\d+) \((\d+) parameter states\), "
                        r"before training rollout (\d+)", run.log)
    assert [(int(push), int(rollout)) for push, _, rollout in resets] == [(1, 0), (2, 2)], resets
    assert int(resets[0][1]) == 0 and int(resets[1][1]) > 0, resets

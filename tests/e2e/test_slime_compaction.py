"""The ``compaction`` plugin inside slime's own ``train.py`` on this CPU (``cpu`` plugin).

slime's RolloutManager calls the compaction generate hook with its built-in ``kv_lookup`` environment
against the torch engine (through slime's router); the context budget is small, so every episode
compacts once and comes back as two segments (two ``Sample``s sharing one ``rollout_id``). Evidence
comes from slime's own output only:

* segments trained: slime's train-side ``log_rollout_data`` reports ``rollout/round_number`` (the
  segment index, mean > 0 only if later segments reached training) and ``rollout/compaction_decay``
  (< 1: earlier segments' advantages were decayed); the train data slime dumps with ``--dump-details``
  holds every segment of every rollout with its advantages;
* rollouts counted once: ``train/global_batch_size`` is the number of rollouts, and one step per
  rollout although there are twice as many samples;
* the reward varies: ``ascend_compaction_env_reward: false`` hands rewards to slime's ``--rm-type
  random`` (the tiny model never answers the lookup), shared by all segments of a rollout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slime_ascend.demo.slime_job import make_prompts, run_slime, slime_flags
from e2e_fixtures import engine, model_dir  # noqa: F401  (pytest fixtures)

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.timeout(1200)]

PLUGINS = ("cpu", "compaction")
NUM_ROLLOUT = 2
# slime's --rm-type random draws 0/1 per rollout and GRPO's advantage is zero in a group whose draws are all
# equal: 4 samples a prompt make that 1/8 per group, so no gradient in either step is a 1-in-4096 event
# (with 2 samples a prompt and 4 prompts it was 1 in 256, and happened in a local full-suite run)
BATCH, N_SAMPLES = 2, 4
ROLLOUTS_PER_STEP = BATCH * N_SAMPLES

# a short episode (3 facts, one noise line each) in a 1024-token budget that compacts after the first
# action: the byte-level prompt is ~400 tokens, so C - |h| < 700 right away; one compaction per rollout
# (tests/e2e/test_slime_prefix_cache_cpu.py runs the same episode)
EPISODE = {
    "ascend_compaction_env_reward": "false",
    "ascend_compaction_env_kwargs": json.dumps({"num_facts": 3, "noise_lines": 1, "answer_turns": 1}),
    "ascend_compaction_context_budget": "1024",
    "ascend_compaction_trigger_tokens": "700",
    "ascend_compaction_max_compactions": "1",
    "ascend_compaction_keep_pairs": "1",
    "ascend_compaction_summary_max_tokens": "8",
    "ascend_compaction_use_chat_template": "false",
}
SETTINGS = {
    **EPISODE,
    # lambda = 1 - 1/(1.5 l) < 1 per rollout, so earlier segments' advantages are visibly decayed (GRPO's
    # default --lambd 1 would make every decay factor exactly 1)
    "ascend_compaction_lambda_mode": "length_adaptive",
}


def _train_dumps(dump: Path) -> list[dict]:
    import torch

    files = sorted((dump / "train_data").glob("*.pt"))
    return [torch.load(f, weights_only=False) for f in files]


def test_train_py_compaction_with_builtin_env(model_dir, engine, tmp_path):
    config = tmp_path / "ascend.yaml"
    sets = [w for k, v in SETTINGS.items() for w in ("--set", f"{k}={v}")]
    subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", *PLUGINS, *sets, "-o", str(config)],
                   check=True, capture_output=True, text=True)
    prompts = make_prompts(tmp_path / "prompts.jsonl")
    dump = tmp_path / "dump"
    flags = slime_flags(model_dir, prompts, [engine], tmp_path, num_rollout=NUM_ROLLOUT, batch=BATCH,
                        n_samples=N_SAMPLES)
    flags += ["--seq-length", "2048", "--dump-details", str(dump)]
    run = run_slime("train.py", flags, tmp_path, PLUGINS, custom_config=config)
    assert run.returncode == 0, run.log[-6000:]

    for role in ("RolloutManager", "MegatronTrainRayActor"):
        assert any(role in line and "slime-ascend plugins active: compaction, cpu" in line
                   or role in line and "slime-ascend plugins active: cpu, compaction" in line
                   for line in run.log.splitlines()), role

    metrics = run.metrics()
    train_steps = [m for m in metrics if "train/grad_norm" in m]
    # rollouts counted once: one step per rollout of ROLLOUTS_PER_STEP rollouts (2x as many samples)
    assert [m["train/step"] for m in train_steps] == list(range(NUM_ROLLOUT)), train_steps
    assert all(m["train/global_batch_size"] == ROLLOUTS_PER_STEP for m in train_steps), train_steps
    assert any(m["train/grad_norm"] > 0 for m in train_steps), train_steps

    # segments trained: the segment index and the cross-segment decay in slime's train-side rollout log
    rollout_logs = [m for m in metrics if "rollout/round_number" in m]
    assert len(rollout_logs) >= NUM_ROLLOUT, sorted(run.metric_keys())
    for m in rollout_logs:
        assert m["rollout/round_number"] > 0, m
        assert 0 < m["rollout/compaction_decay"] < 1, m
        assert "rollout/advantages" in m, m

    # the per-rollout counts reach slime's trackers (TensorBoard here) at each rollout step: every rollout
    # was compacted once (two segments), and the segment index and decay at each train step
    tracked = run.tracked()
    counts = {tag: [v for _, v in tracked[tag]] for tag in tracked if tag.startswith("rollout/compaction_")}
    assert counts["rollout/compaction_rollouts"] == [ROLLOUTS_PER_STEP] * NUM_ROLLOUT, counts
    assert counts["rollout/compaction_compactions"] == [ROLLOUTS_PER_STEP] * NUM_ROLLOUT, counts
    assert counts["rollout/compaction_segments_per_rollout"] == [2.0] * NUM_ROLLOUT, counts
    assert counts["rollout/compaction_max_segments"] == [2.0] * NUM_ROLLOUT, counts
    assert [step for step, _ in tracked["rollout/compaction_decay"]] == list(range(NUM_ROLLOUT)), tracked.keys()

    # slime's own train-data dump: every segment of every rollout, trained with its advantages
    dumps = _train_dumps(dump)
    assert len(dumps) == NUM_ROLLOUT, [sorted(d) for d in dumps]
    for payload in dumps:
        by_rollout: dict[int, dict[int, dict]] = {}
        for sample in payload["samples"]:
            by_rollout.setdefault(int(sample["rollout_ids"]), {})[int(sample["round_number"])] = sample
        assert len(by_rollout) == ROLLOUTS_PER_STEP, sorted(by_rollout)
        for rid, segments in by_rollout.items():
            assert sorted(segments) == [0, 1], (rid, sorted(segments))
            first, last = segments[0], segments[1]
            # one reward per rollout (the last segment's), the earlier segment's credit decayed
            assert float(first["rewards"]) == float(last["rewards"]), rid
            assert 0 < float(first["compaction_decay"]) < 1 and float(last["compaction_decay"]) == 1, rid
    # trained with non-zero advantages (in a step where some group's random rewards differed)
    assert any(float(abs(s["advantages"]).max()) > 0 for payload in dumps for s in payload["samples"])

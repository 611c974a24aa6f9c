"""``reward-mix`` in slime's own ``train.py`` on this CPU: a declared mix of slime's ``random`` rule, an outcome
reward model (``orm.score`` over SGLang's ``/classify``: the torch engine serving a tiny reward model), a generative
judge (``judge.verdict`` over ``/generate``: the torch engine serving the tiny judge, whose verdict is known), a
grader that fails on every fourth sample, and a length penalty.

Evidence from slime's output: each sample's components, failure and policy version in slime's train-data
dump (forwarded to training); the failed samples train nothing; the per-term means at slime's rollout
steps in its trackers (TensorBoard events); the reward model's server counts one /classify input per sample."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slime_ascend.demo.slime_job import make_prompts, run_slime, slime_flags
from e2e_fixtures import engine, model_dir  # noqa: F401  (pytest fixtures)

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.timeout(1200)]

PLUGINS = ("cpu", "reward-mix")
NUM_ROLLOUT, BATCH, N_SAMPLES = 2, 4, 2


def test_train_py_reward_mix_rule_orm_judge_failures_and_metrics(model_dir, engine, tmp_path):
    import json
    import urllib.request

    import torch

    from slime_ascend.demo.slime_job import start_engines, stop
    from slime_ascend.reward_mix import tiny_judge
    from slime_ascend.rollout.torch_engine.model import build_byte_tokenizer, save_model
    from slime_ascend.rollout.torch_engine.reward_model import tiny_reward_model

    reward_dir = save_model(tiny_reward_model(seed=5), tmp_path / "tiny-rm", build_byte_tokenizer())
    judge_dir = tiny_judge.build(tmp_path / "tiny-judge")
    rm, judge = start_engines([reward_dir, judge_dir], [tmp_path / "rm.log", tmp_path / "judge.log"], ready=False)
    try:
        _run_and_check(model_dir, engine, tmp_path, rm.url, judge.url)
        with urllib.request.urlopen(rm.url + "/server_info", timeout=30) as resp:
            scored = json.loads(resp.read())["scored_inputs"]
        assert scored == NUM_ROLLOUT * BATCH * N_SAMPLES  # every sample scored by the reward model, once
    finally:
        stop(rm.proc)
        stop(judge.proc)


def _run_and_check(model_dir, engine, tmp_path, rm_url, judge_url):
    import torch

    config = tmp_path / "ascend.yaml"
    subprocess.run([sys.executable, "-m", "slime_ascend.cli", "config", *PLUGINS, "-o", str(config)], check=True,
                   capture_output=True, text=True)
    cfg = yaml.safe_load(config.read_text())
    cfg["ascend_reward_components"] = [{"name": "correct", "rm_type": "random", "weight": 1.0},
                                       {"name": "orm", "path": "slime_ascend.reward_mix.orm.score", "weight": 0.5,
                                        "kwargs": {"url": rm_url}},
                                       {"name": "judge", "path": "slime_ascend.reward_mix.judge.verdict",
                                        "weight": 0.25, "kwargs": {"url": judge_url, "template": "{prompt}{response}",
                                                                   "verdicts": {"Y": 1.0, "N": 0.0},
                                                                   "max_new_tokens": 1}},  # tiny_judge's one token
                                       {"name": "flaky", "path": "reward_terms.flaky", "weight": 0.5}]
    cfg["ascend_reward_penalties"] = [{"name": "length", "path": "slime_ascend.reward_mix.terms.response_length",
                                       "lambda": 0.25, "kwargs": {"budget": 4}}]
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    dumps = tmp_path / "dumps"
    flags = slime_flags(model_dir, make_prompts(tmp_path / "prompts.jsonl"), [engine], tmp_path,
                        num_rollout=NUM_ROLLOUT, batch=BATCH, n_samples=N_SAMPLES)
    flags += ["--save-debug-train-data", str(dumps / "train_{rollout_id}.pt")]
    run = run_slime("train.py", flags, tmp_path, PLUGINS, custom_config=config,
                    extra_env={"PYTHONPATH": str(Path(__file__).parent)})
    assert run.returncode == 0, run.log[-6000:]

    failed_total, orm_scores = 0, set()
    for rollout_id in range(NUM_ROLLOUT):
        samples = torch.load(dumps / f"train_{rollout_id}.pt", weights_only=False)["samples"]
        assert len(samples) == BATCH * N_SAMPLES
        for s in samples:
            record = s["metadata"]["reward_mix"]  # forwarded to training with the sample
            assert record["weight_versions"] == [str(rollout_id + 1)], record
            c, p = record["components"], record["penalties"]
            # the model terms answered every sample: the reward model a finite score, the judge a verdict
            assert isinstance(c["orm"], float) and c["judge"] in (0.0, 1.0), record
            orm_scores.add(c["orm"])
            if s["sample_index"] % 4 == 3:  # the grader failed: an environment failure, not a low reward
                failed_total += 1
                assert record["failure"].startswith("flaky: TimeoutError") and record["total"] is None, record
                assert float(s["loss_masks"].sum()) == 0, s["sample_index"]  # trains nothing
            else:
                assert record["failure"] is None
                assert record["total"] == pytest.approx(c["correct"] + 0.5 * c["orm"] + 0.25 * c["judge"]
                                                        + 0.5 * c["flaky"] - 0.25 * p["length"])
                assert float(s["loss_masks"].sum()) > 0
    assert failed_total == NUM_ROLLOUT * BATCH * N_SAMPLES // 4
    assert len(orm_scores) > 1  # the reward model scored each text, not a constant

    tracked = run.tracked()
    for tag in ("rollout/reward_mix_correct", "rollout/reward_mix_orm", "rollout/reward_mix_judge",
                "rollout/reward_mix_flaky", "rollout/reward_mix_penalty_length",
                "rollout/reward_mix_total"):
        assert [step for step, _ in tracked.get(tag, [])] == list(range(NUM_ROLLOUT)), (tag, sorted(tracked))
    assert [v for _, v in tracked["rollout/reward_mix_failed"]] == [BATCH * N_SAMPLES / 4] * NUM_ROLLOUT

"""The measurement job's pieces that run without slime's loop: its flags, the probe's reading, its rollouts."""

from __future__ import annotations

import json
import shlex

import pytest

from slime_ascend.demo.slime_job import TINY_QWEN3_ARGS
from slime_ascend.memory import measure
from slime_ascend.rollout.torch_engine.model import TINY_QWEN3_KWARGS

TINY = dict(TINY_QWEN3_KWARGS, model_type="qwen3")


def _values(flags: list[str]) -> list[object]:
    """Flags with numbers as numbers (1e-06 and 1e-6 are one value to Megatron's parser)."""
    out: list[object] = []
    for tok in flags:
        try:
            out.append(float(tok))
        except ValueError:
            out.append(tok)
    return out


def test_arch_flags_of_the_tiny_model_are_the_e2e_jobs():
    assert _values(measure.qwen3_arch_flags(TINY)) == _values(shlex.split(TINY_QWEN3_ARGS))


def test_read_probe_takes_step_1_of_each_rollout(tmp_path):
    state = {"params": 10, "grads": 20, "optimizer": 30}
    rows = [(0, 0, 1000, 1500), (0, 1, 1100, 1900), (0, 2, 1120, 1700),   # rollout 0: step 1 peaks at 1700
            (1, 0, 1130, 1800), (1, 1, 1140, 2000), (1, 2, 1150, 5140)]   # rollout 1: step 1 peaks at 5140
    path = tmp_path / "probe.jsonl"
    path.write_text("".join(json.dumps({"pid": 7, "rollout": r, "step": s, "rss": rss, "hwm": hwm,
                                        "model_state": state}) + "\n" for r, s, rss, hwm in rows))
    got = measure.read_probe(path, [2048, 8192])
    assert [(m.tokens, m.step_bytes, m.baseline_rss, m.model_state_bytes) for m in got] == \
        [(2048, 1700 - 1100, 1100, 60), (8192, 5140 - 1140, 1140, 60)]
    with pytest.raises(RuntimeError, match="rollout 2"):
        measure.read_probe(path, [2048, 8192, 4096])


@pytest.mark.slime
def test_rollouts_load_in_slime_as_one_micro_batch_per_step(tmp_path):
    from slime.observability.rollout_data_utils import load_debug_rollout_data

    template = measure.write_rollouts(tmp_path, [2048, 8192], vocab=1024)
    for rid, tokens in enumerate([2048, 8192]):
        samples = load_debug_rollout_data(template, rollout_id=rid)
        assert len(samples) == measure.STEPS_PER_ROLLOUT * measure.SAMPLES_PER_STEP
        assert {len(s.tokens) for s in samples} == {tokens // measure.SAMPLES_PER_STEP}
        assert all(s.response_length == len(s.loss_mask) == len(s.tokens) - measure.PROMPT_TOKENS for s in samples)
        assert all(3 <= t < 1024 for s in samples for t in s.tokens)

"""The demo's task: the environment, the reward and the starting checkpoints RL begins from."""

from __future__ import annotations

import random

import pytest

from conftest import need
from slime_ascend.demo.task import (
    DOMAINS,
    DigitsEnv,
    Transcript,
    answer_for,
    make_episodes,
    score_action,
    task_transcripts,
)


def test_answers_and_scores():
    assert [answer_for("copy", d) for d in (0, 9)] == ["0", "9"]
    assert [answer_for("next", d) for d in (0, 9)] == ["1", "0"]
    assert score_action(" 7 and more", "7") == 1.0 and score_action("k", "7") == 0.0
    with pytest.raises(ValueError, match="domain"):
        answer_for("add", 1)


def test_env_asks_after_the_fillers_and_scores_the_answer():
    env = DigitsEnv()
    first = env.reset(seed=3, task={"domain": "next", "digit": 4, "fillers": 2})
    assert "next" not in first
    mid = env.step("x")
    assert not mid.done and "next 4 =" not in mid.observation
    last = env.step("y")
    assert not last.done and last.observation.endswith("next 4 =")
    end = env.step("5")
    assert end.done and end.reward == 1.0 and end.info["correct"]
    with pytest.raises(ValueError, match="after the episode ended"):
        env.step("5")
    with pytest.raises(ValueError, match="task="):
        env.reset(task={"domain": "copy"})


def test_episodes_alternate_domains_and_mark_a_fraction_long():
    eps = make_episodes(random.Random(0), 32, 0.25, (2, 3))
    assert [e.domain for e in eps[:4]] == ["copy", "next", "copy", "next"]
    assert sum(e.fillers > 0 for e in eps) == 8
    assert all(e.fillers in (0, 2, 3) for e in eps)


def test_transcripts_supervise_the_answer_then_eos():
    from slime_ascend.rollout.torch_engine.model import build_byte_tokenizer

    tok = build_byte_tokenizer()
    examples = task_transcripts(tok)
    assert len(examples) == 10 * len(DOMAINS)
    for ex in examples:
        assert isinstance(ex, Transcript) and ex.domain in DOMAINS
        (pos_a, answer), (pos_e, eos) = ex.targets
        # the logit at pos predicts the token at pos + 1
        assert ex.ids[pos_a + 1] == answer and ex.ids[pos_e + 1] == eos == tok.eos_token_id
        assert tok.decode([answer]).isdigit()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    need("transformers")
    from slime_ascend.demo.task import prepare_checkpoints

    return prepare_checkpoints(tmp_path_factory.mktemp("ckpt"), seed=5)


def test_checkpoints_start_hedging_and_teachers_are_domain_experts(checkpoints):
    from slime_ascend.demo.task import checkpoint_answer_probs

    probs = checkpoint_answer_probs(checkpoints)
    for dom in DOMAINS:
        assert 0.2 <= probs["policy"][dom] <= 0.4, probs  # knows the task but hedges (start_prob 0.3)
        other = next(d for d in DOMAINS if d != dom)
        assert probs[dom][dom] >= 0.85, probs  # the expert of its domain
        assert probs[dom][other] <= 0.4, probs  # and only of its domain


def test_checkpoints_are_deterministic_given_the_seed(checkpoints, tmp_path):
    from slime_ascend.demo.task import prepare_checkpoints
    from slime_ascend.rollout.torch_engine.model import load_state_dict_from_dir

    again = prepare_checkpoints(tmp_path, seed=5)
    for name in ("policy", "copy"):
        a, b = load_state_dict_from_dir(checkpoints[name]), load_state_dict_from_dir(again[name])
        assert a.keys() == b.keys()
        assert all(a[k].equal(b[k]) for k in a), name


def test_soft_label_sft_reaches_the_requested_probability():
    need("transformers")
    from slime_ascend.demo.task import _answer_prob, _sft
    from slime_ascend.rollout.torch_engine.model import build_byte_tokenizer, load_model

    tok = build_byte_tokenizer()
    examples = task_transcripts(tok)[:4]
    model = load_model(None, seed=0).float()
    digits = [int(tok.encode(str(d), add_special_tokens=False)[0]) for d in range(10)]
    _sft(model, examples, 150, 3e-3, answer_prob=0.5, answer_ids=digits)
    assert _answer_prob(model, examples) == pytest.approx(0.5, abs=0.05)
    # head only: nothing but lm_head moves
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _sft(model, examples, 5, 1e-2, answer_prob=0.3, answer_ids=digits, head_only=True)
    changed = {k for k, v in model.state_dict().items() if not v.equal(before[k])}
    assert changed == {"lm_head.weight"}
    with pytest.raises(ValueError, match="answer_prob"):
        _sft(model, examples, 1, 1e-3, answer_prob=[0.5])
    with pytest.raises(ValueError, match="answer_ids"):
        _sft(model, examples, 1, 1e-3, answer_prob=0.5)


def test_async_task_reward_single_and_batch_mode():
    """slime calls --custom-rm-path in batch mode (a list) for the segments a custom generate returns."""
    import asyncio
    import types

    from slime_ascend.demo.task import async_task_reward

    right = types.SimpleNamespace(index=0, response="5", metadata={"task": {"domain": "next", "digit": 4, "fillers": 0}})
    wrong = types.SimpleNamespace(index=1, response="x", metadata={"task": {"domain": "copy", "digit": 4, "fillers": 0}})
    segment = types.SimpleNamespace(index=2, response="", metadata={"env_info": {"correct": True}})
    assert asyncio.run(async_task_reward(None, right)) == 1.0
    assert asyncio.run(async_task_reward(None, [right, wrong, segment])) == [1.0, 0.0, 1.0]

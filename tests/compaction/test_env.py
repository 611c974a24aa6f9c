"""Built-in key-value lookup environment and environment construction."""

import pytest

from slime_ascend.compaction.env import Environment, KeyValueLookupEnv, StepResult, make_env


def _run(env, actions):
    results = []
    for a in actions:
        r = env.step(a)
        results.append(r)
        if r.done:
            break
    return results


def test_deterministic_per_seed_and_varies_across_seeds():
    a, b, c = KeyValueLookupEnv(num_facts=5), KeyValueLookupEnv(num_facts=5), KeyValueLookupEnv(num_facts=5)
    assert a.reset(seed=3) == b.reset(seed=3)
    c.reset(seed=4)
    ra = [r.observation for r in _run(a, ["look"] * 5)]
    rb = [r.observation for r in _run(b, ["junk"] * 5)]
    rc = [r.observation for r in _run(c, ["look"] * 5)]
    assert ra == rb  # any action advances identically
    assert ra != rc


def test_gibberish_actions_advance_to_the_end_with_zero_reward():
    env = KeyValueLookupEnv(num_facts=4, answer_turns=2)
    env.reset(seed=1)
    results = _run(env, ["#@!"] * 100)
    assert len(results) == 4 + 2
    assert results[-1].done and results[-1].reward == 0.0
    assert all(not r.done for r in results[:-1])
    assert "Question" in results[3].observation and env.query_key in results[3].observation


def test_question_is_about_an_early_fact_and_correct_answer_is_rewarded():
    env = KeyValueLookupEnv(num_facts=6, query_early=2)
    env.reset(seed=11)
    obs = [env.step("look").observation for _ in range(6)]
    revealed = {}
    for o in obs:
        key, value = o.splitlines()[0].split("] ")[1].split(" = ")
        revealed[key] = value
    assert list(revealed).index(env.query_key) < 2
    final = env.step(f"thinking... ANSWER: {revealed[env.query_key]}")
    assert final.done and final.reward == 1.0 and final.info["correct"]


def test_wrong_or_early_answer_scores_zero_and_step_after_done_raises():
    env = KeyValueLookupEnv(num_facts=3)
    env.reset(seed=2)
    r = env.step("ANSWER: 12345")
    assert r.done and r.reward == 0.0
    with pytest.raises(ValueError, match="reset"):
        env.step("look")


def test_make_env_builtin_dotted_and_errors():
    env = make_env(None, {"num_facts": 2})
    assert isinstance(env, KeyValueLookupEnv) and env.num_facts == 2
    assert isinstance(env, Environment)
    assert isinstance(make_env("slime_ascend.compaction.env.KeyValueLookupEnv"), KeyValueLookupEnv)
    with pytest.raises(ValueError, match="built-in"):
        make_env("no_such_env")
    with pytest.raises(TypeError, match="reset"):
        make_env("slime_ascend.compaction.env.StepResult", {"observation": "", "done": True})
    with pytest.raises(ValueError):
        KeyValueLookupEnv(num_facts=0)
    assert StepResult("x", False).reward is None

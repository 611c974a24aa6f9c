"""Which verifiers a job uses, the gate over them at start (the ``verifier-gate`` plugin), the built-in
environments' and the demo task's declared cases, and ``slime-ascend check --verifiers``."""

from __future__ import annotations

import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import yaml

from slime_ascend.plugins import runtime
from slime_ascend.verifiers.gate import VerifierGateError, declare_cases
from slime_ascend.verifiers.job import check_config, gate, verifiers_of

HERE = __name__


def _lenient_cases():
    return {"oracle": [{"response": "7", "label": "7"}], "no_action": [{"response": "", "label": "7"}],
            "unfinished": [{"response": "", "label": "7", "status": "truncated"}]}


@declare_cases(_lenient_cases)
def contains_reward(args, sample):
    """The classic bug: the given answer is searched in the label, and '' is in every string."""
    return 1.0 if sample.response.strip()[:1] in sample.label else 0.0


@declare_cases(_lenient_cases)
async def exact_reward(args, sample):
    return 1.0 if sample.response.strip() == sample.label else 0.0


def undeclared_reward(args, sample):
    return 0.0


@declare_cases(_lenient_cases)
def exiting_reward(args, sample):
    """Calls sys.exit(0) where the agent did nothing: without the gate's guard the process ends with status 0."""
    if not sample.response:
        sys.exit(0)
    return 1.0 if sample.response.strip() == sample.label else 0.0


_release = [threading.Event()]  # set by an in-process test when it ends, so its abandoned loop stops spinning


@declare_cases(_lenient_cases)
def hanging_reward(args, sample):
    """Loops in Python for ever where the agent did nothing (in ``check``'s process: until it exits)."""
    release = _release[0]
    while not sample.response and not release.is_set():
        pass
    return 1.0 if sample.response.strip() == sample.label else 0.0


def _hanging_cases():
    release = _release[0]
    while not release.is_set():
        pass


def _args(**kw):
    return SimpleNamespace(**kw)


def test_the_builtin_environments_and_the_demo_reward_pass_the_gate():
    for env in ("kv_lookup", "slime_ascend.demo.task.DigitsEnv"):
        (verifier, results), = gate(_args(ascend_compaction_env=env), ["compaction"])
        assert verifier.kind == "environment" and len(results) >= 3
    (verifier, results), = gate(_args(custom_rm_path="slime_ascend.demo.task.task_reward"), [])
    assert verifier.kind == "reward function" and len(results) == 5


def test_kv_lookup_cases_follow_its_parameters():
    from slime_ascend.compaction.env import KeyValueLookupEnv

    cases = KeyValueLookupEnv(num_facts=3, answer_turns=1).verifier_cases()
    assert len(cases["oracle"][0]["actions"]) == 4 and cases["oracle"][0]["actions"][-1].startswith("ANSWER: ")
    assert gate(_args(ascend_compaction_env="kv_lookup", ascend_compaction_env_kwargs={"num_facts": 3}),
                ["compaction"])


def test_a_reward_function_that_rewards_an_empty_answer_is_refused_in_one_line():
    with pytest.raises(VerifierGateError) as info:
        gate(_args(custom_rm_path=f"{HERE}.contains_reward"), ["verifier-gate"])
    line = str(info.value)
    assert line.startswith(f"verifier '{HERE}.contains_reward' fails the no_action check")
    assert "got reward 1.0" in line and "\n" not in line


def test_an_async_reward_function_is_awaited_and_passes():
    (verifier, results), = gate(_args(custom_rm_path=f"{HERE}.exact_reward"), [])
    assert [r.reward for r in results] == [1.0, 0.0, 0.0]


def test_a_verifier_without_cases_is_refused_unless_allowed():
    args = _args(custom_rm_path=f"{HERE}.undeclared_reward")
    with pytest.raises(VerifierGateError, match="declares no verifier-gate cases.*ascend_verifier_gate_cases"):
        gate(args, [])
    assert gate(args, [], require_cases=False) == []


def test_cases_given_in_the_settings_replace_the_declared_ones():
    args = _args(custom_rm_path=f"{HERE}.undeclared_reward",
                 ascend_verifier_gate_cases={f"{HERE}.undeclared_reward": f"{HERE}._lenient_cases"})
    with pytest.raises(VerifierGateError, match="fails the oracle check"):  # it rewards nothing, not even the oracle
        gate(args, ["verifier-gate"])


def test_which_verifiers_each_plugin_brings():
    both = _args(ascend_compaction_env="kv_lookup", ascend_opd_task_rm_path="slime_ascend.demo.task.task_reward",
                 custom_rm_path="slime_ascend.opd.hooks.reward")
    assert [v.name for v in verifiers_of(both, ["compaction", "opd"])] == [
        "kv_lookup", "slime_ascend.demo.task.task_reward"]  # opd owns --custom-rm-path: its task reward is the verifier
    mix = _args(ascend_reward_components=[{"name": "c", "path": "slime_ascend.demo.task.task_reward"},
                                          {"name": "m", "rm_type": "math"}],
                custom_rm_path="slime_ascend.reward_mix.hooks.reward")
    assert [(v.kind, v.name) for v in verifiers_of(mix, ["reward-mix"])] == [
        ("reward function", "slime_ascend.demo.task.task_reward"), ("rm_type rule", "rm_type:math")]
    assert [v.name for v in verifiers_of(_args(rm_type="deepscaler"), [])] == ["rm_type:deepscaler"]
    off = _args(ascend_compaction_env="kv_lookup", ascend_compaction_env_reward=False, rm_type="math")
    assert [v.name for v in verifiers_of(off, ["compaction"])] == ["rm_type:math"]


def test_an_unresolvable_reward_path_is_one_line():
    with pytest.raises(VerifierGateError, match="reward function 'no.such.fn' does not resolve.*Fix:"):
        gate(_args(custom_rm_path="no.such.fn"), [])


def test_the_plugin_refuses_at_validation_and_names_the_environment(tmp_path):
    args = _args(ascend_plugins="compaction,verifier-gate", custom_rm_path=None,
                 ascend_compaction_env=f"{HERE}.GenerousEnv")
    with pytest.raises(VerifierGateError, match=f"verifier '{HERE}.GenerousEnv' fails the no_action check"):
        runtime.check(args)
    runtime.check(_args(ascend_plugins="compaction,verifier-gate", ascend_compaction_env="kv_lookup"))


def test_a_verifier_that_calls_sys_exit_is_refused_at_validation_in_one_line():
    args = _args(ascend_plugins="verifier-gate", custom_rm_path=f"{HERE}.exiting_reward")
    with pytest.raises(VerifierGateError) as info:
        runtime.check(args)
    line = str(info.value)
    assert line.startswith(f"verifier '{HERE}.exiting_reward' fails the no_action check (case 0): the verifier "
                           "called sys.exit(0)") and "Fix:" in line and "\n" not in line


@pytest.mark.parametrize(("what", "settings", "phrase"), [
    ("scoring", {"custom_rm_path": f"{HERE}.hanging_reward"},
     f"verifier '{HERE}.hanging_reward' fails the no_action check (case 0): no answer within 0.5 s"),
    ("cases", {"custom_rm_path": f"{HERE}.undeclared_reward",
               "ascend_verifier_gate_cases": {f"{HERE}.undeclared_reward": f"{HERE}._hanging_cases"}},
     f"the verifier-gate cases of '{HERE}.undeclared_reward': no answer within 0.5 s"),
])
def test_a_verifier_that_never_answers_is_refused_at_its_deadline(what, settings, phrase):
    import time

    args = _args(ascend_plugins="verifier-gate", ascend_verifier_gate_timeout_s=0.5, **settings)
    start = time.monotonic()
    try:
        with pytest.raises(VerifierGateError) as info:
            runtime.check(args)
    finally:
        _release[0].set()
        _release[0] = threading.Event()
    assert time.monotonic() - start < 10
    line = str(info.value)
    assert line.startswith(phrase) and "raise ascend_verifier_gate_timeout_s" in line and "\n" not in line


def test_the_deadline_setting_is_checked():
    from slime_ascend.plugins.settings import SettingsError

    with pytest.raises(SettingsError, match="ascend_verifier_gate_timeout_s=0.*below the minimum"):
        gate(_args(custom_rm_path=f"{HERE}.exact_reward", ascend_verifier_gate_timeout_s=0), [])


class GenerousEnv:
    """Ends every episode at its first action with reward 1, whatever the action."""

    system_prompt = ""

    def reset(self, seed=None, task=None):
        return "answer"

    def step(self, action):
        from slime_ascend.compaction.env import StepResult

        return StepResult("", True, 1.0)

    def verifier_cases(self):
        return {"oracle": [{"actions": ["42"]}], "no_action": [{"actions": [""]}], "unfinished": [{"actions": []}]}


class TurnLimitPayingEnv:
    """The environment that fooled the gate: it pays 1.0 to any episode that reaches its turn limit, whatever the
    agent did, and nothing before; its declared no_action and unfinished runs stop short of the limit."""

    system_prompt = ""
    max_turns = 6

    def reset(self, seed=None, task=None):
        self.turns = 0
        return "answer when you like"

    def step(self, action):
        from slime_ascend.compaction.env import StepResult

        self.turns += 1
        if action == "42":
            return StepResult("", True, 1.0)
        return StepResult("", True, 1.0) if self.turns >= self.max_turns else StepResult("go on", False, None)

    def verifier_cases(self):
        return {"oracle": [{"actions": ["42"]}], "no_action": [{"actions": ["", ""]}],
                "unfinished": [{"actions": ["", ""]}]}


class PaysAlongTheWayEnv(TurnLimitPayingEnv):
    """Reports a reward of 1.0 on steps that do not end the episode: an unfinished episode already stands at 1."""

    def step(self, action):
        from slime_ascend.compaction.env import StepResult

        self.turns += 1
        if action == "42":
            return StepResult("", True, 1.0)
        return StepResult("", True, 0.0) if self.turns >= self.max_turns else StepResult("go on", False, 1.0)


def test_an_environment_that_pays_for_reaching_its_turn_limit_is_caught_by_the_no_op_played_to_the_end():
    with pytest.raises(VerifierGateError, match=r"fails the no_action check \(case 0\): a run where the agent did "
                                                 r"nothing got reward 1.0"):
        gate(_args(ascend_compaction_env=f"{HERE}.TurnLimitPayingEnv", ascend_compaction_env_reward=True),
             ["compaction", "verifier-gate"])


def test_an_unfinished_episode_is_scored_as_it_stands_not_zeroed_by_the_harness():
    with pytest.raises(VerifierGateError, match=r"fails the unfinished check \(case 0\): an unfinished run got "
                                                 r"reward 1.0"):
        gate(_args(ascend_compaction_env=f"{HERE}.PaysAlongTheWayEnv", ascend_compaction_env_reward=True),
             ["compaction", "verifier-gate"])


def test_the_no_op_run_stops_at_the_end_of_the_episode_and_at_the_turn_limit():
    from slime_ascend.verifiers.gate import EnvRun
    from slime_ascend.verifiers.scoring import MAX_NOOP_TURNS, env_scorer

    steps = []

    class Endless(TurnLimitPayingEnv):
        max_turns = None

        def step(self, action):
            from slime_ascend.compaction.env import StepResult

            steps.append(action)
            return StepResult("go on", False, None)

    assert env_scorer(Endless)(EnvRun(("x", ""), until_done=True)) is None
    assert steps == ["x"] + [""] * (MAX_NOOP_TURNS - 1)  # the declared actions, then the last one repeated
    steps.clear()
    assert env_scorer(Endless)(EnvRun(("x", ""))) is None and steps == ["x", ""]  # not marked: as declared


def _math_cases():
    return {"oracle": [{"response": "The answer is \\boxed{12}", "label": "12"}],
            "no_action": [{"response": "", "label": "12"}],
            "unfinished": [{"response": "Let me compute 3 times", "label": "12", "status": "truncated"}]}


@pytest.mark.slime
def test_slimes_rm_type_rules_are_gated_through_slimes_own_async_rm():
    from conftest import need

    need("slime.rollout.rm_hub")
    args = _args(rm_type="math", custom_rm_path=None,
                 ascend_verifier_gate_cases={"rm_type:math": f"{HERE}._math_cases"})
    (verifier, results), = gate(args, ["verifier-gate"])
    assert verifier.kind == "rm_type rule" and [r.reward for r in results] == [1.0, 0.0, 0.0]
    # inside reward-mix, the rule is scored as the rule (not through the hook on --custom-rm-path)
    mix = _args(ascend_reward_components=[{"name": "m", "rm_type": "math"}],
                custom_rm_path="slime_ascend.reward_mix.hooks.reward",
                ascend_verifier_gate_cases={"rm_type:math": f"{HERE}._math_cases"})
    assert gate(mix, ["reward-mix", "verifier-gate"])


def test_check_verifiers_cli_reports_each_verifier(tmp_path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump({"ascend_plugins": "compaction", "ascend_compaction_env": "kv_lookup"}))
    bad.write_text(yaml.safe_dump({"custom_rm_path": f"{HERE}.contains_reward"}))
    assert len(check_config(str(good))) == 1
    import os
    from pathlib import Path

    def run(path):  # this test module is importable from its folder: the bad YAML names one of its functions
        return subprocess.run([sys.executable, "-m", "slime_ascend.cli", "check", "--verifiers", str(path)],
                              capture_output=True, text=True, cwd=Path(__file__).parent,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([".", os.environ.get("PYTHONPATH", "")])},
                              timeout=120)

    ok = run(good)
    assert ok.returncode == 0 and "ok    environment kv_lookup" in ok.stdout, ok.stdout + ok.stderr
    failed = run(bad)
    assert failed.returncode == 1 and "fails the no_action check" in failed.stdout, failed.stdout + failed.stderr
    (tmp_path / "list.yaml").write_text("- 1\n")
    refused = run(tmp_path / "list.yaml")
    assert refused.returncode == 2 and "not a mapping" in refused.stderr and "Traceback" not in refused.stderr
    # a verifier that calls sys.exit(0) or never answers fails in one line; the command goes on and exits 1
    both = tmp_path / "both.yaml"
    both.write_text(yaml.safe_dump({"ascend_plugins": "reward-mix", "ascend_verifier_gate_timeout_s": 3,
                                    "ascend_reward_components": [{"name": "exit", "path": f"{HERE}.exiting_reward"},
                                                                 {"name": "hang", "path": f"{HERE}.hanging_reward"}]}))
    failed = run(both)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert f"verifier '{HERE}.exiting_reward' fails the no_action check (case 0): the verifier called sys.exit(0)" \
        in failed.stdout
    assert f"verifier '{HERE}.hanging_reward' fails the no_action check (case 0): no answer within 3 s" in failed.stdout
    assert "2 verifier(s) fail the gate" in failed.stdout and "Traceback" not in failed.stderr


@pytest.mark.slime
@pytest.mark.slow
def test_slimes_parse_args_refuses_a_verifier_that_rewards_an_empty_answer(tmp_path):
    """In slime's own driver: the bootstrap's driver.validate_at_parse_args runs the gate on slime's parsed args,
    so the job stops before Ray starts, in one line naming the verifier and the check."""
    from pathlib import Path

    from slime_parse_args import error_lines, parse_args

    proc = parse_args(tmp_path, ["verifier-gate"], "--custom-rm-path", "test_verifier_job.contains_reward",
                      pythonpath=(str(Path(__file__).parent),))
    assert proc.returncode == 2 and "PARSED" not in proc.stdout, (proc.stdout[-2000:], proc.stderr[-3000:])
    lines = error_lines(proc)
    assert len(lines) == 1 and "verifier 'test_verifier_job.contains_reward' fails the no_action check" in lines[0], \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr

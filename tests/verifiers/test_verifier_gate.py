"""The verifier gate's three checks (pure) and how declared cases are read."""

from __future__ import annotations

import math
import sys
import threading
import time

import pytest
from hypothesis import given, strategies as st

from slime_ascend.verifiers.gate import (CHECKS, TIMEOUT_SETTING, Call, EnvRun, GateCases, SampleRun, VerifierGateError,
                                         call_within, coerce_cases, declare_cases, failures, refusal, run_gate)


def _cases(n: int = 1) -> GateCases:
    return GateCases(oracle=(SampleRun("right"),) * n, no_action=(SampleRun(""),) * n,
                     unfinished=(SampleRun("ri", status="truncated"),) * n)


def _by_response(table):
    return lambda run: table[run.response]


def test_a_sound_verifier_passes_every_check():
    results = run_gate("v", _by_response({"right": 1.0, "": 0.0, "ri": None}), _cases(2))
    assert [r.check for r in results] == ["oracle", "oracle", "no_action", "no_action", "unfinished", "unfinished"]
    assert not failures(results)


@pytest.mark.parametrize(("table", "check", "phrase"), [
    ({"right": 0.0, "": 0.0, "ri": 0.0}, "oracle", "not a reward above 0"),
    ({"right": None, "": 0.0, "ri": 0.0}, "oracle", "not a reward above 0"),
    ({"right": 1.0, "": 1.0, "ri": 0.0}, "no_action", "did nothing got reward 1.0"),
    ({"right": 1.0, "": 0.0, "ri": 0.5}, "unfinished", "unfinished run got reward 0.5"),
    ({"right": math.inf, "": 0.0, "ri": 0.0}, "oracle", "not finite"),
    ({"right": 1.0, "": math.nan, "ri": 0.0}, "no_action", "not finite"),
])
def test_each_broken_rule_fails_its_check_and_is_named(table, check, phrase):
    bad = failures(run_gate("my.verifier", _by_response(table), _cases()))
    assert [r.check for r in bad] == [check]
    line = refusal(bad[0])
    assert line.startswith(f"verifier 'my.verifier' fails the {check} check") and phrase in line and "Fix:" in line
    assert "\n" not in line


def test_a_penalty_for_doing_nothing_is_allowed():
    assert not failures(run_gate("v", _by_response({"right": 1.0, "": -0.5, "ri": -1.0}), _cases()))


def test_a_verifier_that_raises_fails_that_check_with_the_exception():
    def score(run):
        if run.response == "":
            raise KeyError("label")
        return 1.0 if run.response == "right" else 0.0

    bad = failures(run_gate("v", score, _cases()))
    assert [r.check for r in bad] == ["no_action"] and "raised KeyError" in bad[0].detail


def test_a_verifier_that_never_answers_fails_at_its_deadline_and_nothing_after_it_is_scored():
    stop = threading.Event()
    scored = []

    def score(run):
        scored.append(run.response)
        if run.response == "":
            while not stop.is_set():  # loops in Python for ever (until the test ends it)
                pass
        return 1.0 if run.response == "right" else 0.0

    start = time.monotonic()
    try:
        results = run_gate("slow.verifier", score, _cases(2), timeout_s=0.3)
    finally:
        stop.set()
    assert time.monotonic() - start < 5
    assert scored == ["right", "right", ""]  # the second no_action case and the unfinished ones never start
    assert [(r.check, r.case, r.passed) for r in results] == [("oracle", 0, True), ("oracle", 1, True),
                                                              ("no_action", 0, False)]
    line = refusal(results[-1])
    assert line.startswith("verifier 'slow.verifier' fails the no_action check (case 0): no answer within 0.3 s")
    assert f"raise {TIMEOUT_SETTING}" in line.split("Fix:")[1] and "\n" not in line


@pytest.mark.parametrize(("exc", "phrase"), [(SystemExit(0), "called sys.exit(0)"),
                                             (SystemExit("bye"), "called sys.exit('bye')"),
                                             (KeyboardInterrupt(), "raised KeyboardInterrupt")])
def test_a_verifier_that_exits_or_interrupts_fails_that_check_and_the_gate_goes_on(exc, phrase):
    def score(run):
        if run.response == "":
            raise exc
        return 1.0 if run.response == "right" else 0.0

    results = run_gate("v", score, _cases())
    assert [(r.check, r.passed) for r in results] == [("oracle", True), ("no_action", False), ("unfinished", True)]
    assert phrase in refusal(results[1])


def test_call_within_returns_the_value_or_the_error_and_a_real_ctrl_c_still_stops_the_wait():
    assert call_within(lambda: 3, 1.0) == Call(True, 3, None)
    assert isinstance(call_within(lambda: sys.exit(2), None).error, SystemExit)
    assert not call_within(lambda: time.sleep(2), 0.05).finished
    import _thread
    import signal

    # Python's own Ctrl-C handler, as in a terminal: a pytest started as a background job of a non-interactive shell
    # inherits SIGINT ignored, and interrupt_main then does nothing
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.2, _thread.interrupt_main).start()  # the user's Ctrl-C reaches the waiting thread
        with pytest.raises(KeyboardInterrupt):
            call_within(lambda: time.sleep(3), 10.0)
    finally:
        signal.signal(signal.SIGINT, previous)


@given(oracle=st.floats(allow_nan=True, allow_infinity=True), empty=st.floats(allow_nan=True, allow_infinity=True))
def test_the_rules_on_any_rewards(oracle, empty):
    results = run_gate("v", _by_response({"right": oracle, "": empty, "ri": 0.0}), _cases())
    failed = {r.check for r in failures(results)}
    assert ("oracle" in failed) == (not (math.isfinite(oracle) and oracle > 0))
    assert ("no_action" in failed) == (not (math.isfinite(empty) and empty <= 0))
    assert "unfinished" not in failed


def test_cases_are_read_from_plain_mappings_of_either_run_type():
    env = coerce_cases({"oracle": [{"actions": ["a", "b"], "seed": 1}], "no_action": {"actions": [""]},
                        "unfinished": [EnvRun(("a",))]}, EnvRun, "env")
    assert env.oracle == (EnvRun(("a", "b"), seed=1),) and env.no_action == (EnvRun(("",)),)
    samples = coerce_cases({"oracle": [{"response": "x", "label": "x"}], "no_action": [{"response": ""}],
                            "unfinished": [{"response": "x", "status": "truncated"}]}, SampleRun, "fn")
    assert samples.unfinished[0].status == "truncated"
    assert coerce_cases(_cases(), SampleRun, "fn") == _cases()


@pytest.mark.parametrize(("declared", "phrase"), [
    ({"oracle": [{"response": "x"}], "no_action": [{"response": ""}]}, "no unfinished runs declared"),
    ({"oracle": [], "no_action": [{"response": ""}], "unfinished": [{"response": ""}]}, "GateCases.oracle is empty"),
    ({"oracle": [{"reply": "x"}], "no_action": [{}], "unfinished": [{}]}, "unknown field(s) ['reply']"),
    ({"oracle": [{"actions": ["x"]}], "no_action": [{}], "unfinished": [{}]}, "unknown field(s) ['actions']"),
    ({"oracle": [1], "no_action": [], "unfinished": []}, "is a int"),
    ({"oracle": [], "no_action": [], "unfinished": [], "extra": []}, "unknown check(s) ['extra']"),
    (["oracle"], "not GateCases or a mapping"),
    ({c: [{"response": ""}] * 65 for c in CHECKS}, "at most 64"),
])
def test_malformed_declarations_are_refused_naming_the_field(declared, phrase):
    with pytest.raises(VerifierGateError, match=None) as info:
        coerce_cases(declared, SampleRun, "the cases of 'fn'")
    assert phrase in str(info.value), str(info.value)


def test_declare_cases_marks_the_function_and_leaves_it_callable():
    @declare_cases(_cases)
    def reward(args, sample):
        return 1.0

    assert reward.verifier_cases is _cases and reward(None, None) == 1.0

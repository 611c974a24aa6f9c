"""The three checks of the verifier gate (pure: no slime, no Ray).

A verifier is scored on its declared cases (:class:`GateCases`) through a ``score(case) -> float | None``
callable (:mod:`.scoring` builds it the way training scores). The rules:

* ``oracle``: every oracle case gets a finite reward above 0;
* ``no_action`` and ``unfinished``: every case gets nothing, i.e. ``None`` or a finite reward of at most 0
  (a penalty is allowed, a reward is not). An environment's ``no_action`` run is played to the end of its episode
  (its last action, the no-op, repeated up to the turn limit), and an ``unfinished`` one is scored as the
  environment itself scores the episode as it stands (:mod:`.scoring`): the harness makes no reward up.

A verifier that raises on a case fails that check (training would fail or lose the sample there too); so does one
that calls ``sys.exit`` (a ``SystemExit`` or ``KeyboardInterrupt`` raised by the verifier is its failure, not the
end of the process that runs the gate) and one that does not answer within its deadline (``timeout_s``, the
``ascend_verifier_gate_timeout_s`` setting): each call runs in a daemon thread the gate stops waiting for (Python
cannot stop a thread: a verifier looping for ever is left behind, and none of its later cases is scored).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..command import UserError

CHECKS = ("oracle", "no_action", "unfinished")
MAX_CASES = 64  # per check: the gate runs at start-up, so it is bounded
TIMEOUT_SETTING = "ascend_verifier_gate_timeout_s"  # the deadline of one verifier call (the plugin's setting)


class VerifierGateError(UserError):
    """A verifier failed the gate, or its cases are malformed; the message names the environment and the check."""


@dataclass(frozen=True)
class EnvRun:
    """One episode of an environment: ``reset(seed, task)``, then ``actions`` one by one."""

    actions: tuple[str, ...]
    seed: int | None = None
    task: Any = None
    until_done: bool = False  # go on with the last action until the episode ends (the gate sets it on no_action runs)


@dataclass(frozen=True)
class SampleRun:
    """One sample for a reward function: the fields of slime's ``Sample`` a reward function reads."""

    response: str
    prompt: Any = ""
    label: Any = None
    metadata: dict = field(default_factory=dict)
    status: str = "completed"  # slime's Sample.Status value: completed, truncated, aborted
    response_length: int | None = None


@dataclass(frozen=True)
class GateCases:
    """Per check, the runs a verifier is scored on (each check at least one run, at most :data:`MAX_CASES`)."""

    oracle: tuple
    no_action: tuple
    unfinished: tuple

    def __post_init__(self) -> None:
        for check in CHECKS:
            runs = getattr(self, check)
            if isinstance(runs, (EnvRun, SampleRun)):
                runs = (runs,)
            runs = tuple(runs)
            if not runs:
                raise VerifierGateError(f"GateCases.{check} is empty. Fix: declare at least one {check} run")
            if len(runs) > MAX_CASES:
                raise VerifierGateError(f"GateCases.{check} has {len(runs)} runs (at most {MAX_CASES}). "
                                        "Fix: declare fewer")
            for run in runs:
                if not isinstance(run, (EnvRun, SampleRun)):
                    raise VerifierGateError(f"GateCases.{check} holds a {type(run).__name__}; "
                                            "Fix: use EnvRun (environments) or SampleRun (reward functions)")
            object.__setattr__(self, check, runs)


def coerce_cases(declared: Any, run_type: type, where: str) -> GateCases:
    """A verifier's declared cases as :class:`GateCases` of ``run_type`` runs. ``declared`` is a GateCases or a
    plain mapping ``{check: [run, ...]}`` whose runs are ``run_type`` objects or dicts of their fields (so an
    environment can declare its cases without importing this module)."""
    if isinstance(declared, GateCases):
        runs = {check: getattr(declared, check) for check in CHECKS}
    elif isinstance(declared, Mapping):
        unknown = sorted(set(map(str, declared)) - set(CHECKS))
        if unknown:
            raise VerifierGateError(f"{where}: unknown check(s) {unknown}; the checks are {list(CHECKS)}")
        missing = [c for c in CHECKS if c not in declared]
        if missing:
            raise VerifierGateError(f"{where}: no {missing[0]} runs declared. Fix: declare runs for {list(CHECKS)}")
        runs = {check: declared[check] for check in CHECKS}
    else:
        raise VerifierGateError(f"{where}: the declared cases are a {type(declared).__name__}, not GateCases or a "
                                f"mapping of {list(CHECKS)} to runs")
    fields = {f.name for f in dataclasses.fields(run_type)}
    built = {}
    for check, items in runs.items():
        if isinstance(items, (EnvRun, SampleRun, Mapping)):
            items = (items,)
        out = []
        for i, item in enumerate(items):
            if isinstance(item, Mapping):
                extra = sorted(set(map(str, item)) - fields)
                if extra:
                    raise VerifierGateError(f"{where}: {check}[{i}] has unknown field(s) {extra}; a "
                                            f"{run_type.__name__} has {sorted(fields)}")
                try:
                    item = run_type(**{**item, **({"actions": tuple(item["actions"])} if "actions" in item else {})})
                except TypeError as exc:
                    raise VerifierGateError(f"{where}: {check}[{i}]: {exc}") from None
            if not isinstance(item, run_type):
                raise VerifierGateError(f"{where}: {check}[{i}] is a {type(item).__name__}; this verifier is scored "
                                        f"on {run_type.__name__} runs")
            out.append(item)
        built[check] = tuple(out)
    return GateCases(**built)


def declare_cases(producer: Callable[[], GateCases]):
    """Decorator for a reward function: ``@declare_cases(my_cases)`` where ``my_cases() -> GateCases``.

    It records the producer on the function itself (``fn.verifier_cases``); the function is otherwise unchanged."""

    def mark(fn):
        fn.verifier_cases = producer
        return fn

    return mark


@dataclass(frozen=True)
class Call:
    """How one verifier call ended: ``finished`` with its ``value`` or the ``error`` it raised (any
    ``BaseException``), or not finished by its deadline."""

    finished: bool
    value: Any = None
    error: BaseException | None = None


def call_within(fn: Callable[[], Any], timeout_s: float | None) -> Call:
    """``fn()`` in a daemon thread, waited for at most ``timeout_s`` seconds (None: for ever).

    Whatever ``fn`` raises is caught in its thread, ``SystemExit`` and ``KeyboardInterrupt`` included (the
    verifier's own, not the user's: a Ctrl-C arrives in the waiting thread and stops the wait)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - a verifier's sys.exit() is its failure, not ours
            box["error"] = exc

    thread = threading.Thread(target=target, name="verifier-gate-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return Call(False)
    return Call(True, box.get("value"), box.get("error"))


def raised(exc: BaseException) -> str:
    """What a verifier's exception says, in a few words on one line."""
    if isinstance(exc, SystemExit):
        return f"the verifier called sys.exit({exc.code!r})"
    text = " ".join(str(exc).split())[:200]
    return f"the verifier raised {type(exc).__name__}" + (f": {text}" if text else "")


def timed_out(timeout_s: float) -> tuple[str, str]:
    """The detail and the fix of a verifier call that did not answer by its deadline."""
    return (f"no answer within {timeout_s:g} s ({TIMEOUT_SETTING}; the call is left running and the verifier's "
            "later cases are not scored)",
            f"make the verifier answer sooner (does it loop or wait for ever?), or raise {TIMEOUT_SETTING}")


@dataclass(frozen=True)
class CheckResult:
    verifier: str
    check: str
    case: int
    reward: float | None
    passed: bool
    detail: str = ""
    fix: str = ""  # the refusal's Fix where it is not "correct the verifier"


def _passes(check: str, reward: float | None) -> tuple[bool, str]:
    if reward is not None and not math.isfinite(reward):
        return False, f"reward {reward} is not finite"
    if check == "oracle":
        if reward is None or reward <= 0:
            return False, f"the oracle solution got {reward!r}, not a reward above 0"
        return True, ""
    if reward is not None and reward > 0:
        what = "a run where the agent did nothing" if check == "no_action" else "an unfinished run"
        return False, f"{what} got reward {reward!r}"
    return True, ""


def run_gate(verifier: str, score: Callable[[Any], float | None], cases: GateCases,
             timeout_s: float | None = None) -> list[CheckResult]:
    """Score every case of every check, each call within ``timeout_s`` seconds (None: no deadline); one
    :class:`CheckResult` per case, in check order, up to a call that did not answer (its failure is the last)."""
    results = []
    for check in CHECKS:
        for i, run in enumerate(getattr(cases, check)):
            if check == "no_action" and isinstance(run, EnvRun):  # played to the end, not stopped where declared
                run = dataclasses.replace(run, until_done=True)
            call = call_within(lambda run=run: score(run), timeout_s)
            if not call.finished:
                detail, fix = timed_out(timeout_s)
                results.append(CheckResult(verifier, check, i, None, False, detail, fix))
                return results
            if call.error is not None:  # the verifier's own failure is the finding
                results.append(CheckResult(verifier, check, i, None, False, raised(call.error)))
                continue
            value = call.value
            try:
                reward = None if value is None else float(value)
            except (TypeError, ValueError):
                results.append(CheckResult(verifier, check, i, None, False,
                                           f"the verifier returned {type(value).__name__}, not a number"))
                continue
            ok, detail = _passes(check, reward)
            results.append(CheckResult(verifier, check, i, reward, ok, detail))
    return results


def failures(results: Sequence[CheckResult]) -> list[CheckResult]:
    return [r for r in results if not r.passed]


def refusal(result: CheckResult) -> str:
    """The one line a failed check is refused with."""
    return (f"verifier {result.verifier!r} fails the {result.check} check (case {result.case}): {result.detail}. "
            f"Fix: {result.fix or 'correct the verifier (or its declared cases) before training with it'}")

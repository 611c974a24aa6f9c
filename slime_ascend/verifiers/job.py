"""The verifiers a slime job trains with, found from its ``args``, and the gate run over them.

What counts as a verifier, by plugin (the first that owns the reward wins, as in slime):

* ``compaction`` with ``ascend_compaction_env_reward`` on: the environment (``ascend_compaction_env``);
* ``opd``: its task reward ``ascend_opd_task_rm_path`` (when set);
* ``reward-mix``: each component with a ``path`` or an ``rm_type`` (penalties are not verifiers);
* otherwise slime's own ``--custom-rm-path``, else its ``--rm-type`` rule.

Cases come from the verifier itself (an environment's ``verifier_cases()``, a function marked with
:func:`~.gate.declare_cases`) or from ``ascend_verifier_gate_cases`` (verifier name -> ``module.fn`` returning
:class:`~.gate.GateCases`; names: the environment spec, the function's dotted path, ``rm_type:NAME``).

Every call into a verifier (building an environment, producing its cases, scoring a case) has the deadline
``ascend_verifier_gate_timeout_s`` (:func:`~.gate.call_within`), read whether or not the plugin is enabled.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..plugins.base import resolve
from ..command import UserError
from .gate import (TIMEOUT_SETTING, EnvRun, GateCases, SampleRun, VerifierGateError, call_within, coerce_cases,
                   failures, raised, refusal, run_gate, timed_out)
from .scoring import env_scorer, preload, reward_fn_scorer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verifier:
    name: str  # as the refusal names it and as ascend_verifier_gate_cases keys it
    kind: str  # environment | reward function | rm_type rule
    score: Callable[[Any], float | None]
    cases: Callable[[], GateCases] | None  # None: it declares none


def _settings(plugin_name: str, args: Any) -> dict[str, Any]:
    from ..plugins import registry, runtime

    return runtime.settings_values(registry.available()[plugin_name], args)


def _timeout(args: Any) -> float:
    return _settings("verifier-gate", args)[TIMEOUT_SETTING]


def _within(what: str, fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()`` (a call into a verifier's code) within the deadline; a timeout, a ``sys.exit`` or an exception
    that is not already one line for the user is a :class:`VerifierGateError` naming ``what``."""
    call = call_within(fn, timeout_s)
    if not call.finished:
        detail, fix = timed_out(timeout_s)
        raise VerifierGateError(f"{what}: {detail}. Fix: {fix}")
    if call.error is None:
        return call.value
    if isinstance(call.error, (UserError, ValueError)):
        raise call.error
    raise VerifierGateError(f"{what}: {raised(call.error)}. Fix: correct the verifier before training with it")


def _load(what: str, path: str) -> Any:
    try:
        return resolve(path)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's path
        raise VerifierGateError(f"{what} {path!r} does not resolve ({type(exc).__name__}: "
                                f"{' '.join(str(exc).split())[:200]}). Fix: correct the dotted path module.fn") from None


def _rule_scorer(rm_type: str, args: Any) -> Callable:
    preload("slime.rollout.rm_hub")

    async def rule(args_: Any, sample: Any) -> Any:
        from slime.rollout.rm_hub import async_rm

        rule_args = copy.copy(args_)
        rule_args.rm_type = rm_type
        rule_args.custom_rm_path = None  # the rule itself, not the hook a plugin put there
        return await async_rm(rule_args, sample)

    return reward_fn_scorer(rule, args)


def verifiers_of(args: Any, names: list[str]) -> list[Verifier]:
    """The verifiers the job ``args`` trains with (see the module docstring), with their cases if declared."""
    found: list[Verifier] = []
    overrides: Mapping[str, str] = {}
    timeout_s = _timeout(args)
    if "verifier-gate" in names:
        overrides = _settings("verifier-gate", args)["ascend_verifier_gate_cases"] or {}

    def producer(name: str, declared: Callable[[], GateCases] | None) -> Callable[[], GateCases] | None:
        if name in overrides:
            return _load(f"ascend_verifier_gate_cases[{name!r}]", str(overrides[name]))
        return declared

    if "compaction" in names:
        comp = _settings("compaction", args)
        if comp["ascend_compaction_env_reward"]:
            from ..compaction.env import make_env

            spec, kwargs = comp["ascend_compaction_env"], comp["ascend_compaction_env_kwargs"]

            def factory(spec=spec, kwargs=kwargs):
                return make_env(spec, kwargs)

            declared = _within(f"environment {spec!r} (built to read its verifier_cases)",
                               lambda: getattr(factory(), "verifier_cases", None), timeout_s)
            found.append(Verifier(spec, "environment", env_scorer(factory), producer(spec, declared)))
    paths: list[str] = []
    rules: list[str] = []
    if "opd" in names:
        task_rm = _settings("opd", args)["ascend_opd_task_rm_path"]
        if task_rm:
            paths.append(task_rm)
    elif "reward-mix" in names:
        from ..reward_mix.mix import parse_terms

        for term in parse_terms(_settings("reward-mix", args)["ascend_reward_components"], "ascend_reward_components"):
            (paths.append(term.path) if term.path is not None else rules.append(term.rm_type))
    elif not found:
        if getattr(args, "custom_rm_path", None):
            paths.append(args.custom_rm_path)
        elif getattr(args, "rm_type", None):
            rules.append(args.rm_type)
    for path in dict.fromkeys(paths):
        fn = _load("reward function", path)
        found.append(Verifier(path, "reward function", reward_fn_scorer(fn, args),
                              producer(path, getattr(fn, "verifier_cases", None))))
    for rule in dict.fromkeys(rules):
        name = f"rm_type:{rule}"
        found.append(Verifier(name, "rm_type rule", _rule_scorer(rule, args), producer(name, None)))
    return found


def gate(args: Any, names: list[str], *, require_cases: bool = True,
         refuse: bool = True) -> list[tuple[Verifier, list]]:
    """Run the three checks on every verifier of the job; raise :class:`VerifierGateError` (one line) at the first
    failure (``refuse``; else every result is returned), or for a verifier without cases when ``require_cases``.
    Returns each verifier with its results."""
    done = []
    timeout_s = _timeout(args)
    for verifier in verifiers_of(args, names):
        if verifier.cases is None:
            if require_cases:
                raise VerifierGateError(
                    f"{verifier.kind} {verifier.name!r} declares no verifier-gate cases. Fix: declare them "
                    "(an environment's verifier_cases(), @declare_cases on a reward function, or "
                    f"ascend_verifier_gate_cases: {{{verifier.name}: module.fn}}), or set "
                    "ascend_verifier_gate_require_cases: false")
            logger.warning("verifier gate: %s %r declares no cases; not checked", verifier.kind, verifier.name)
            continue
        where = f"the verifier-gate cases of {verifier.name!r}"
        cases = coerce_cases(_within(where, verifier.cases, timeout_s),
                             EnvRun if verifier.kind == "environment" else SampleRun, where)
        results = run_gate(verifier.name, verifier.score, cases, timeout_s)
        bad = failures(results)
        if bad and refuse:
            raise VerifierGateError(refusal(bad[0]))
        done.append((verifier, results))
        if bad:
            continue
        logger.info("verifier gate: %s %r passes oracle, no_action and unfinished (%d cases)", verifier.kind,
                    verifier.name, len(results))
    return done


_passed: set[tuple] = set()


def validate(args: Any, settings: Any) -> None:
    """The ``verifier-gate`` plugin's start-up check (once per process and job)."""
    from ..plugins import runtime

    names = runtime.enabled_names(args)
    key = (tuple(names), repr(sorted((k, repr(v)) for k, v in vars(args).items()
                                     if k.startswith("ascend_") or k in ("custom_rm_path", "rm_type"))))
    if key in _passed:
        return
    done = gate(args, names, require_cases=bool(settings.require_cases))
    if not done:
        raise VerifierGateError("verifier-gate is enabled but the job uses no verifier it can check (no compaction "
                                "environment, reward function or --rm-type). Fix: disable verifier-gate or set one")
    _passed.add(key)


def check_config(path: str) -> list[tuple[Verifier, list]]:
    """``slime-ascend check --verifiers CONFIG``: the gate over the job a YAML describes (the YAML given to slime's
    ``--custom-config-path``, which may also hold slime's ``custom_rm_path`` / ``rm_type``)."""
    from types import SimpleNamespace

    import yaml

    from ..files import MAX_JSON_BYTES, read_regular_file
    from ..plugins import registry, runtime

    try:
        data = yaml.safe_load(read_regular_file(path, max_bytes=MAX_JSON_BYTES))
    except yaml.YAMLError as exc:
        mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
        where = (f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None and problem
                 else " ".join(str(exc).split())[:300])
        raise VerifierGateError(f"--verifiers {path}: not valid YAML ({where}). Fix: give the YAML `slime-ascend "
                                "config` writes") from None
    if not isinstance(data, dict):
        raise VerifierGateError(f"--verifiers {path}: the YAML is not a mapping of settings. Fix: give the YAML "
                                "`slime-ascend config` writes")
    args = SimpleNamespace(**data)
    names = registry.parse_names(getattr(args, runtime.ARGS_KEY, None) or [])
    if "verifier-gate" not in names:
        names = [*names, "verifier-gate"]
    require = _settings("verifier-gate", args)["ascend_verifier_gate_require_cases"]
    return gate(args, names, require_cases=bool(require), refuse=False)

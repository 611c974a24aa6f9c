"""slime's side of ``reward-mix``: the reward model, the failure rule and the metrics.

* ``reward`` (reward_model slot, slime's ``--custom-rm-path`` through our dispatcher): every declared term
  of one sample, concurrently; ``Sample.metadata["reward_mix"]`` (and ``train_metadata``, forwarded to
  training by ``rollout.forward_metadata``) keeps ``components``, ``penalties``, ``total``, ``failure`` and
  the sample's ``weight_versions``. A sample whose term failed gets a placeholder 0.0 and the reason. A
  rule term (``rm_type``) runs slime's ``async_rm`` with that type on a view of the sample without its
  own ``metadata["rm_type"]`` / ``custom_rm_path`` (which slime would prefer), so in a mixed dataset each
  term computes the rule it declares.
* ``fail_unscored`` (reward_post_process, order 50): a failed sample is an environment failure, not a low
  reward: its status becomes FAILED and ``remove_sample`` (slime trains nothing on it); its raw reward
  (logged) is the mean of its group's scored members. The dispatcher's group normalisation
  (:func:`slime_ascend.hooks.reward_post_process`) leaves every removed FAILED sample out of its group's
  mean and std and gives it 0 (with ``staleness``' group rule, order 100, it is also padded). Then one
  ``reward_mix <rollout_id>: {...}`` report: each term's mean over scored samples, the total, failures.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import logging
import re
import threading
from collections.abc import Sequence
from typing import Any

from ..plugins.base import resolve
from .mix import MixError, Term, as_number, combine, parse_terms

logger = logging.getLogger("slime_ascend.reward_mix")
META = "reward_mix"
_lock = threading.Lock()
_parsed: dict[int, tuple[tuple[Term, ...], tuple[Term, ...]]] = {}
_rule_args: dict[tuple[int, str], Any] = {}


def terms(args: Any) -> tuple[tuple[Term, ...], tuple[Term, ...]]:
    """(components, penalties) of ``args``, parsed once per ``args``."""
    with _lock:
        cached = _parsed.get(id(args))
    if cached is None:
        from ..plugins import runtime

        s = runtime.settings(args, "reward-mix")
        cached = (parse_terms(s.components, "ascend_reward_components"),
                  parse_terms(s.penalties, "ascend_reward_penalties", penalty=True))
        with _lock:
            _parsed[id(args)] = cached
    return cached


def validate(args: Any, settings: Any) -> None:
    """Start-up check (the plugin runtime passes this plugin's settings view): what would otherwise fail every
    sample later is refused now, in one line. At least one component with a non-zero weight; every ``path``
    resolves to a callable that takes ``(args, sample, **kwargs)`` with the term's kwargs; every ``rm_type``
    is one of the rules this slime's ``async_rm`` implements (``boxed_`` prefix allowed)."""
    components = parse_terms(settings.components, "ascend_reward_components")
    penalties = parse_terms(settings.penalties, "ascend_reward_penalties", penalty=True)
    if not components:
        raise MixError("ascend_reward_components is empty. Fix: declare at least one component, e.g. "
                       "[{name: correctness, rm_type: math}]")
    if all(t.coef == 0 for t in components):
        raise MixError(f"every weight of ascend_reward_components is 0 ({[t.name for t in components]}): every "
                       "reward would be 0 - penalties. Fix: give at least one component a non-zero weight")
    rules = _rule_names()
    for term in components + penalties:
        where = f"reward-mix term {term.name!r}"
        if term.path is not None:
            try:
                fn = _function(term.path)
            except Exception as exc:  # noqa: BLE001 - an import error of any kind is the user's path
                raise MixError(f"{where}: path {term.path!r} does not resolve ({type(exc).__name__}: "
                               f"{' '.join(str(exc).split())[:200]}). Fix: correct the dotted path module.fn, and "
                               "put its package on PYTHONPATH of the driver and of `ray start`") from None
            _check_signature(where, term, fn)
            check = getattr(fn, "check_kwargs", None)  # a ready-made term's own check (orm.score, judge.verdict)
            if check is not None:
                try:
                    check(**dict(term.kwargs))
                except ValueError as exc:
                    raise MixError(f"{where}: {exc}") from None
        elif rules is not None and term.rm_type.removeprefix("boxed_") not in rules:
            raise MixError(f"{where}: rm_type {term.rm_type!r} is not a rule of this slime's async_rm (it has "
                           f"{', '.join(sorted(rules))}; boxed_<rule> too). Fix: use one of them, or a path to "
                           "your own function")


def _check_signature(where: str, term: Term, fn: Any) -> None:
    if not callable(fn):
        raise MixError(f"{where}: path {term.path!r} is a {type(fn).__name__}, not a function. Fix: point path "
                       "at a function fn(args, sample, **kwargs)")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: accepted as it is
        return
    try:
        signature.bind(None, None, **dict(term.kwargs))
    except TypeError as exc:
        raise MixError(f"{where}: {term.path}{signature} cannot be called as fn(args, sample"
                       f"{''.join(f', {k}=...' for k, _ in term.kwargs)}) ({exc}). Fix: match its kwargs to the "
                       "function's parameters") from None


@functools.cache
def _rule_names() -> frozenset[str] | None:
    """The rule names this slime's ``async_rm`` dispatches on (read from its source), None without slime."""
    try:
        from slime.rollout.rm_hub import async_rm

        source = inspect.getsource(async_rm)
    except Exception:  # noqa: BLE001 - no slime here (unit tests, `slime-ascend config`): not checked
        return None
    return frozenset(re.findall(r'rm_type == "([\w.-]+)"', source)) or None


@functools.cache
def _function(path: str):
    return resolve(path)


def _args_with_rm_type(args: Any, rm_type: str) -> Any:
    """A shallow copy of ``args`` whose ``--rm-type`` is the term's and whose custom path is cleared (slime's
    ``async_rm`` would otherwise call our dispatcher back)."""
    key = (id(args), rm_type)
    with _lock:
        base = _rule_args.get(key)
        if base is None:
            base = _rule_args[key] = copy.copy(args)
            base.custom_rm_path = None
            base.rm_type = rm_type
    return base


def _sample_for_rule(sample: Any) -> Any:
    """A shallow copy of ``sample`` that slime's ``async_rm`` scores by ``--rm-type``: it prefers the sample's
    own ``custom_rm_path`` and ``metadata["rm_type"]`` (a mixed dataset's per-sample rule), which would
    override the term's declared rule. The user's sample is not changed; the rest of its metadata (gpqa's
    choices, ifbench's instructions) stays visible to the rule."""
    metadata = getattr(sample, "metadata", None)
    if not getattr(sample, "custom_rm_path", None) and not (isinstance(metadata, dict) and "rm_type" in metadata):
        return sample
    view = copy.copy(sample)
    view.custom_rm_path = None
    if isinstance(metadata, dict):
        view.metadata = {k: v for k, v in metadata.items() if k != "rm_type"}
    return view


async def _call(args: Any, term: Term, sample: Any) -> Any:
    kwargs = dict(term.kwargs)
    if term.rm_type is not None:
        from slime.rollout.rm_hub import async_rm

        return await async_rm(_args_with_rm_type(args, term.rm_type), _sample_for_rule(sample), **kwargs)
    fn = _function(term.path)
    if inspect.iscoroutinefunction(fn):
        return await fn(args, sample, **kwargs)
    # a synchronous judge runs off the event loop, so it cannot serialise the other samples' scoring
    out = await asyncio.to_thread(fn, args, sample, **kwargs)
    return await out if inspect.isawaitable(out) else out


async def _value(args: Any, term: Term, sample: Any, timeout_s: float) -> Any:
    """The term's value, or the exception that fails the sample: its own (SystemExit included: a term that
    calls sys.exit fails its sample, not the rollout) or a TimeoutError after ``timeout_s``. A synchronous
    term still running at its deadline is abandoned in its worker thread (Python cannot stop it)."""
    async def guarded() -> Any:
        try:  # caught inside the task: a SystemExit escaping a task would stop the event loop itself
            return await _call(args, term, sample)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure of a grader fails its sample
            return exc

    task = asyncio.ensure_future(guarded())
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        return TimeoutError(f"no answer within {timeout_s:g} s (ascend_reward_term_timeout_s)")
    return task.result()


async def reward(args: Any, sample: Any, **_: Any) -> float:
    components, penalties = terms(args)
    everything = components + penalties
    from ..plugins import runtime

    timeout_s = runtime.settings(args, "reward-mix").term_timeout_s
    got = await asyncio.gather(*(_value(args, t, sample, timeout_s) for t in everything))
    values = {t.name: v for t, v in zip(everything, got)}
    total, failure = combine(components, penalties, values)

    def shown(term_list):
        return {t.name: (None if isinstance(values[t.name], BaseException) else values[t.name]) for t in term_list}

    record = {"components": shown(components), "penalties": shown(penalties), "total": total, "failure": failure,
              "weight_versions": list(getattr(sample, "weight_versions", None) or [])}
    if getattr(sample, "metadata", None) is None:
        sample.metadata = {}
    sample.metadata[META] = record
    sample.train_metadata = {**(getattr(sample, "train_metadata", None) or {}), META: record}
    if failure is not None:
        logger.warning("reward_mix: sample index=%s not scored (%s)", getattr(sample, "index", None), failure)
    return 0.0 if total is None else total


def _failed(sample: Any) -> bool:
    record = (getattr(sample, "metadata", None) or {}).get(META)
    return bool(record and record.get("failure"))


def fail_unscored(args: Any, samples: Sequence[Any], raw_rewards: list, rewards: list) -> tuple[list, list]:
    raw_out, out = list(raw_rewards), list(rewards)
    groups: dict[Any, list[int]] = {}
    for i, sample in enumerate(samples):
        groups.setdefault(getattr(sample, "group_index", None) if getattr(sample, "group_index", None) is not None
                          else ("alone", i), []).append(i)
    failed = 0
    for members in groups.values():
        scored = [i for i in members if not _failed(samples[i])]
        for i in members:
            if i in scored:
                continue
            failed += 1
            sample = samples[i]
            sample.remove_sample = True
            status = getattr(type(sample), "Status", None)
            if status is not None:
                sample.status = status.FAILED
            if scored:
                raw_out[i] = sum(raw_out[j] for j in scored) / len(scored)
                out[i] = sum(out[j] for j in scored) / len(scored)
    from ..plugins.rollout_metrics import report

    report(args, logger, "reward_mix", metrics(args, samples, failed))
    return raw_out, out


def metrics(args: Any, samples: Sequence[Any], failed: int) -> dict[str, float]:
    components, penalties = terms(args)
    records = [s.metadata[META] for s in samples if (getattr(s, "metadata", None) or {}).get(META)
               and not s.metadata[META].get("failure")]
    out: dict[str, float] = {}
    for prefix, key, term_list in (("", "components", components), ("penalty_", "penalties", penalties)):
        for term in term_list:
            values = [as_number(r[key].get(term.name)) for r in records]
            values = [v for v in values if v is not None]
            out[f"rollout/reward_mix_{prefix}{term.name}"] = sum(values) / len(values) if values else 0.0
    totals = [r["total"] for r in records if r.get("total") is not None]
    out["rollout/reward_mix_total"] = sum(totals) / len(totals) if totals else 0.0
    out["rollout/reward_mix_scored"] = float(len(records))
    out["rollout/reward_mix_failed"] = float(failed)
    return out


def reset() -> None:
    """Forget parsed settings and cached functions (tests)."""
    with _lock:
        _parsed.clear()
        _rule_args.clear()
        _function.cache_clear()

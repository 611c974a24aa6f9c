"""The rollout side of off-policy control: the ``staleness`` plugin (declared in
:mod:`slime_ascend.offpolicy.plugin`) drops stale and environment-failed rollouts before slime builds the
train data.

Runs in the rollout manager as the first step of our ``reward_post_process`` chain (order 100),
inside slime's ``_convert_samples_to_train_data``, before it builds the loss masks. A dropped sample
gets ``sample.remove_sample = True``; slime then replaces its loss mask with zeros
(slime/ray/rollout.py, ``_convert_samples_to_train_data``), so it trains nothing and adds nothing
to its rollout's loss denominator (``rollout_mask_sums``).

Unit: a *rollout* (samples sharing ``rollout_id``, else one sample by ``index``); its versions are all
its samples' ``weight_versions``, it failed if any sample's status is FAILED or ABORTED. Groups are
the rollouts sharing ``group_index`` (none: each rollout alone).

Trainer version: the version every rollout engine acknowledged last
(:mod:`slime_ascend.weight_sync.served_version`, published by the ``driver.acknowledged_weight_update``
patch after it read every engine's version back), or, before any acknowledged switch or where no switch
is acknowledged (another transport), the newest weight version seen so far in this process (the
high-water mark of every ``Sample.weight_versions`` entry that reached this hook: an engine reports v
only after the trainer produced v, so a lower bound); the larger of the two. Each sample's versions are
the ones its engine's responses reported (SGLang ``meta_info["weight_version"]``).
Lag = trainer_version - min(versions); stale iff lag > ``ascend_staleness_tau``.

With ``ascend_staleness_group_rule`` (GLM-5): a rollout is invalid if stale or failed; a group with
fewer than half valid rollouts (``2 * valid < rollouts in the group``) is dropped whole; in a kept
group each invalid rollout is *padded*: dropped, and given the reward and ``rollout_id`` of a valid
rollout of its group (round robin, :func:`~slime_ascend.algorithms.staleness.filter_groups`). The
group normalisation that follows (which counts each ``rollout_id`` once) then sees only the valid
rollouts, so the baseline is the valid members' mean and std, and the group keeps its shape. Without
the rule only stale rollouts are dropped and their rewards stay in the group baseline.

Returns ``(raw_rewards, rewards)``: ``raw_rewards`` unchanged; ``rewards`` unchanged except padded
rollouts (the valid source's reward). Each sample's ``metadata["ascend_staleness"]`` records
``action`` (keep, drop_stale, drop_env_failed, drop_group, pad; a pad also has ``reason``: stale or
env_failed, ``original_rollout_id`` and ``padded_from_index``), ``lag`` and ``trainer_version``; the
counts are kept for :func:`last_staleness_report` and reported on slime's rollout metrics as
``rollout/staleness_*``: a ``staleness <rollout_id>: {...}`` line in the RolloutManager's log and slime's
trackers (:func:`slime_ascend.plugins.rollout_metrics.report`).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..algorithms.staleness import SampleStatus, filter_groups, parse_weight_versions
from ..plugins.settings import SettingsError

__all__ = ["last_staleness_report", "reset_state", "staleness_post_process", "validate_staleness"]

logger = logging.getLogger("slime_ascend.staleness")

FAILED_STATUSES = ("FAILED", "ABORTED")
METRIC_PREFIX = "rollout/staleness_"
METRIC_KEYS = ("rollouts", "kept", "padded", "dropped", "stale", "env_failed", "dropped_groups", "unversioned",
               "max_lag", "trainer_version", "acknowledged_version")

_lock = threading.Lock()
_state: dict[str, Any] = {"high_water": 0, "report": None}


def reset_state() -> None:
    """Forget the version high-water mark and the last report (tests)."""
    with _lock:
        _state.update(high_water=0, report=None)


def last_staleness_report() -> dict[str, Any] | None:
    """Counts and reasons of the last call in this process (a copy), or None before the first."""
    with _lock:
        report = _state["report"]
    return None if report is None else {k: (dict(v) if isinstance(v, dict) else v) for k, v in report.items()}


def staleness_post_process(args: Any, samples: list, raw_rewards: list, rewards: list) -> tuple[list, list]:
    """reward_post_process chain contribution (order 100) of the ``staleness`` plugin."""
    from ..plugins import runtime

    s = runtime.settings(args, "staleness")
    if len(samples) != len(rewards) or len(samples) != len(raw_rewards):
        raise ValueError(f"got {len(samples)} samples, {len(raw_rewards)} raw rewards and {len(rewards)} rewards")
    rewards = list(rewards)
    rollouts = _collect_rollouts(samples, s.unversioned)
    trainer_version, acknowledged = _trainer_version(rollouts.versions)
    lag = {k: (trainer_version - min(v) if v else 0) for k, v in rollouts.versions.items()}
    if s.group_rule:
        decision = _decide_by_group(samples, rollouts, lag, trainer_version, s.tau)
    else:
        decision = _Decision({k: "drop_stale" if lag[k] > s.tau else "keep" for k in rollouts.members})
    _mark_samples(samples, rewards, rollouts, decision, lag, trainer_version)
    report = _report(len(samples), rollouts, decision, lag, trainer_version, s.tau, s.group_rule, acknowledged)
    _publish(args, report)
    return raw_rewards, rewards


# ---- the steps -------------------------------------------------------------------------------------
@dataclass
class _Rollouts:
    """A batch's rollouts, keyed by :func:`_rollout_key`, in order of first appearance."""

    members: dict[Any, list[int]]  # sample indices
    versions: dict[Any, list[int]]  # every weight version its samples report
    failed: dict[Any, bool]  # any sample FAILED or ABORTED
    unversioned: int  # rollouts without a version that did not fail


@dataclass
class _Decision:
    """Each rollout's action (keep, drop_stale, drop_env_failed, drop_group, pad)."""

    action: dict[Any, str]
    alias: dict[Any, Any] = field(default_factory=dict)  # padded rollout -> valid source rollout
    dropped_groups: int = 0


def _status_name(sample: Any) -> str:
    status = getattr(sample, "status", None)
    return str(getattr(status, "name", status)).upper()


def _rollout_key(sample: Any) -> Any:
    return sample.rollout_id if getattr(sample, "rollout_id", None) is not None else ("index", sample.index)


def _collect_rollouts(samples: list, unversioned: str) -> _Rollouts:
    """Group the samples into rollouts with their versions and failure; ``unversioned`` is the setting."""
    members: dict[Any, list[int]] = {}
    for i, sample in enumerate(samples):
        members.setdefault(_rollout_key(sample), []).append(i)
    versions: dict[Any, list[int]] = {}
    failed: dict[Any, bool] = {}
    count = 0
    for key, indices in members.items():
        parsed: list[int] = []
        for i in indices:
            try:
                parsed += parse_weight_versions(list(getattr(samples[i], "weight_versions", None) or []))
            except ValueError as e:
                raise ValueError(f"sample index={samples[i].index}: {e}") from None
        failed[key] = any(_status_name(samples[i]) in FAILED_STATUSES for i in indices)
        if not parsed and not failed[key]:
            if unversioned == "error":
                raise ValueError(
                    f"sample index={samples[indices[0]].index} has no weight_versions, so its staleness is "
                    "unknown. Fix: use an engine that reports meta_info['weight_version'] (SGLang), or set "
                    "ascend_staleness_unversioned: keep"
                )
            count += 1
        versions[key] = parsed
    return _Rollouts(members, versions, failed, count)


def _trainer_version(versions: dict[Any, list[int]]) -> tuple[int, int | None]:
    """(trainer version, acknowledged version or None). Raises the high-water mark to the newest of
    ``versions`` first; the trainer version is the larger of that mark and the acknowledged version."""
    with _lock:
        newest = max([_state["high_water"]] + [v for vs in versions.values() for v in vs])
        _state["high_water"] = newest
    acknowledged = _acknowledged_version()
    return max(newest, acknowledged or 0), acknowledged


def _acknowledged_version() -> int | None:
    """The version every engine acknowledged last in this job (None: no acknowledged switch yet, or not
    under Ray)."""
    if "ray" not in sys.modules:
        return None
    try:
        import ray

        if not ray.is_initialized():
            return None
        from ..weight_sync import served_version

        return served_version.acknowledged()
    except Exception as exc:  # noqa: BLE001 - the high-water mark still bounds the trainer's version
        logger.warning("staleness: could not read the acknowledged weight version (%s); using the newest seen",
                       " ".join(str(exc).split())[:200])
        return None


def _decide_by_group(samples: list, rollouts: _Rollouts, lag: dict[Any, int], trainer_version: int,
                     tau: int) -> _Decision:
    """The GLM-5 group rule (:func:`~slime_ascend.algorithms.staleness.filter_groups`) over the rollouts'
    groups (``group_index``; none: the rollout alone)."""
    groups: dict[Any, list[Any]] = {}
    for key, indices in rollouts.members.items():
        g = getattr(samples[indices[0]], "group_index", None)
        groups.setdefault(("group", g) if g is not None else ("alone", key), []).append(key)
    group_keys = list(groups.values())
    result = filter_groups(
        [[SampleStatus(weight_versions=rollouts.versions[k] or [trainer_version], env_failed=rollouts.failed[k])
          for k in grp] for grp in group_keys],
        trainer_version, tau,
    )
    decision = _Decision({}, dropped_groups=result.dropped_group)
    for grp, kept, src, train in zip(group_keys, result.keep_group, result.source, result.train):
        for j, key in enumerate(grp):
            reason = "drop_env_failed" if rollouts.failed[key] else "drop_stale" if lag[key] > tau else None
            if not kept:
                decision.action[key] = "drop_group" if reason is None else reason
            elif train[j]:
                decision.action[key] = "keep"
            else:
                decision.action[key] = "pad"
                decision.alias[key] = grp[src[j]]
    return decision


def _share_rollout_ids(samples: list, members: dict[Any, list[int]], alias: dict[Any, Any]) -> dict[Any, Any]:
    """Give each padding source an explicit rollout_id (a fresh one where it has none) so that its padded
    siblings can share it; returns source rollout -> that id."""
    taken = {sm.rollout_id for sm in samples if getattr(sm, "rollout_id", None) is not None}
    fresh = max([x for x in taken if isinstance(x, int)] + [-1]) + 1
    source_id: dict[Any, Any] = {}
    for src_key in dict.fromkeys(alias.values()):
        first = samples[members[src_key][0]]
        if first.rollout_id is None:
            while fresh in taken:
                fresh += 1
            for i in members[src_key]:
                samples[i].rollout_id = fresh
            taken.add(fresh)
        source_id[src_key] = first.rollout_id
    return source_id


def _mark_samples(samples: list, rewards: list, rollouts: _Rollouts, decision: _Decision, lag: dict[Any, int],
                  trainer_version: int) -> None:
    """Apply the decision: ``remove_sample`` on every sample not kept, a padded sample takes its source's
    ``rollout_id`` and reward (in ``rewards``), and each sample's ``metadata["ascend_staleness"]`` record."""
    source_id = _share_rollout_ids(samples, rollouts.members, decision.alias)
    for key, indices in rollouts.members.items():
        act = decision.action[key]
        for i in indices:
            sample = samples[i]
            record = {"action": act, "lag": lag[key], "trainer_version": trainer_version}
            if act != "keep":
                sample.remove_sample = True
            if act == "pad":
                record["reason"] = "env_failed" if rollouts.failed[key] else "stale"
                src_first = rollouts.members[decision.alias[key]][0]
                record["original_rollout_id"] = sample.rollout_id
                record["padded_from_index"] = samples[src_first].index
                sample.rollout_id = source_id[decision.alias[key]]
                rewards[i] = rewards[src_first]
            if getattr(sample, "metadata", None) is None:
                sample.metadata = {}
            sample.metadata["ascend_staleness"] = record


def _report(n_samples: int, rollouts: _Rollouts, decision: _Decision, lag: dict[Any, int], trainer_version: int,
            tau: int, group_rule: bool, acknowledged: int | None) -> dict[str, Any]:
    """The counts :func:`last_staleness_report` returns."""
    keys = list(rollouts.members)
    failed, versions = rollouts.failed, rollouts.versions
    per_action = Counter(decision.action[k] for k in keys)
    lag_hist = Counter(lag[k] for k in keys if not failed[k] and versions[k])
    return {
        "samples": n_samples,
        "rollouts": len(keys),
        "trainer_version": trainer_version,
        "tau": tau,
        "kept": per_action["keep"],
        "padded": per_action["pad"],
        "dropped": len(keys) - per_action["keep"] - per_action["pad"],
        "stale": sum(1 for k in keys if not failed[k] and lag[k] > tau),
        "env_failed": sum(1 for k in keys if failed[k]) if group_rule else 0,
        "dropped_groups": decision.dropped_groups,
        "dropped_group_members": per_action["drop_group"],
        "unversioned": rollouts.unversioned,
        "max_lag": max(lag_hist) if lag_hist else 0,
        "lag_histogram": dict(sorted(lag_hist.items())),
        "acknowledged_version": acknowledged if acknowledged is not None else -1,
    }


def _publish(args: Any, report: dict[str, Any]) -> None:
    """Keep the report for :func:`last_staleness_report`, put its counts on slime's rollout metrics and log what
    was not kept."""
    with _lock:
        _state["report"] = report
    from ..plugins.rollout_metrics import report as report_rollout

    report_rollout(args, logger, "staleness", {METRIC_PREFIX + key: float(report[key]) for key in METRIC_KEYS})
    if report["kept"] != report["rollouts"] or report["unversioned"]:
        logger.info(
            "staleness: trainer version %d, tau %d: of %d rollouts kept %d, padded %d, dropped %d; invalid: %d stale "
            "(lag > tau), %d env-failed; %d groups dropped (< half valid) taking %d valid rollouts with them; "
            "%d without a weight version; lags %s",
            report["trainer_version"], report["tau"], report["rollouts"], report["kept"], report["padded"],
            report["dropped"], report["stale"], report["env_failed"], report["dropped_groups"],
            report["dropped_group_members"], report["unversioned"], report["lag_histogram"],
        )


# ---- start-up check --------------------------------------------------------------------------------
def validate_staleness(args: Any, settings: Any) -> None:
    path = getattr(args, "custom_convert_samples_to_train_data_path", None)
    if path and path != "slime_ascend.hooks.convert_samples_to_train_data":
        raise SettingsError(
            f"plugin 'staleness' runs in slime's reward post-process, which the custom converter {path!r} "
            "bypasses. Fix: remove --custom-convert-samples-to-train-data-path"
        )

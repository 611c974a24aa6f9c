"""``staleness``: drop stale and environment-failed rollouts before slime builds the train data.

Runs in the rollout manager as the first step of our ``reward_post_process`` chain (order 100),
inside slime's ``_convert_samples_to_train_data``, before it builds the loss masks. A dropped sample
gets ``sample.remove_sample = True``; slime then replaces its loss mask with zeros
(slime/ray/rollout.py, ``_convert_samples_to_train_data``), so it trains nothing and adds nothing
to its rollout's loss denominator (``rollout_mask_sums``).

Unit: a *rollout* (samples sharing ``rollout_id``, else one sample by ``index``); its versions are all
its samples' ``weight_versions``, it failed if any sample's status is FAILED or ABORTED. Groups are
the rollouts sharing ``group_index`` (none: each rollout alone).

Trainer version (our choice [D]): the newest weight version seen so far in this process, i.e. the
high-water mark of every ``Sample.weight_versions`` entry that reached this hook. The rollout manager
has no direct view of the trainer's counter; an engine reports version v only after the trainer has
produced v, so this is a lower bound of the trainer's version, and lags are never over-estimated.
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
``rollout/staleness_*`` (:func:`report_metrics`).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

from ..algorithms.staleness import SampleStatus, filter_groups, parse_weight_versions
from ..plugins.settings import SettingsError

__all__ = ["last_staleness_report", "report_metrics", "reset_state", "staleness_post_process", "validate"]

logger = logging.getLogger("slime_ascend.staleness")

FAILED_STATUSES = ("FAILED", "ABORTED")

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


def _status_name(sample: Any) -> str:
    status = getattr(sample, "status", None)
    return str(getattr(status, "name", status)).upper()


def _rollout_key(sample: Any) -> Any:
    return sample.rollout_id if getattr(sample, "rollout_id", None) is not None else ("index", sample.index)


def staleness_post_process(args: Any, samples: list, raw_rewards: list, rewards: list) -> tuple[list, list]:
    """reward_post_process chain contribution (order 100) of the ``staleness`` plugin."""
    from ..plugins import runtime

    s = runtime.settings(args, "staleness")
    if len(samples) != len(rewards) or len(samples) != len(raw_rewards):
        raise ValueError(f"got {len(samples)} samples, {len(raw_rewards)} raw rewards and {len(rewards)} rewards")
    rewards = list(rewards)

    # rollouts, in order of first appearance
    members: dict[Any, list[int]] = {}
    for i, sample in enumerate(samples):
        members.setdefault(_rollout_key(sample), []).append(i)
    keys = list(members)
    versions: dict[Any, list[int]] = {}
    failed: dict[Any, bool] = {}
    unversioned = 0
    for key in keys:
        parsed: list[int] = []
        for i in members[key]:
            try:
                parsed += parse_weight_versions(list(getattr(samples[i], "weight_versions", None) or []))
            except ValueError as e:
                raise ValueError(f"sample index={samples[i].index}: {e}") from None
        failed[key] = any(_status_name(samples[i]) in FAILED_STATUSES for i in members[key])
        if not parsed and not failed[key]:
            if s.unversioned == "error":
                raise ValueError(
                    f"sample index={samples[members[key][0]].index} has no weight_versions, so its staleness is "
                    "unknown. Fix: use an engine that reports meta_info['weight_version'] (SGLang), or set "
                    "ascend_staleness_unversioned: keep"
                )
            unversioned += 1
        versions[key] = parsed

    with _lock:
        newest = max([_state["high_water"]] + [v for vs in versions.values() for v in vs])
        _state["high_water"] = newest
    trainer_version, tau = newest, s.tau
    lag = {k: (trainer_version - min(v) if v else 0) for k, v in versions.items()}

    action: dict[Any, str] = {}
    alias: dict[Any, Any] = {}  # padded rollout -> valid source rollout
    dropped_groups = 0
    if s.group_rule:
        groups: dict[Any, list[Any]] = {}
        for key in keys:
            g = getattr(samples[members[key][0]], "group_index", None)
            groups.setdefault(("group", g) if g is not None else ("alone", key), []).append(key)
        group_keys = list(groups.values())
        result = filter_groups(
            [[SampleStatus(weight_versions=versions[k] or [trainer_version], env_failed=failed[k]) for k in grp]
             for grp in group_keys],
            trainer_version, tau,
        )
        dropped_groups = result.dropped_group
        for grp, kept, src, train in zip(group_keys, result.keep_group, result.source, result.train):
            for j, key in enumerate(grp):
                reason = "drop_env_failed" if failed[key] else "drop_stale" if lag[key] > tau else None
                if not kept:
                    action[key] = "drop_group" if reason is None else reason
                elif train[j]:
                    action[key] = "keep"
                else:
                    action[key] = "pad"
                    alias[key] = grp[src[j]]
    else:
        for key in keys:
            action[key] = "drop_stale" if lag[key] > tau else "keep"

    # give each padding source an explicit rollout_id so that its padded siblings can share it
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

    for key in keys:
        act = action[key]
        for i in members[key]:
            sample = samples[i]
            record = {"action": act, "lag": lag[key], "trainer_version": trainer_version}
            if act != "keep":
                sample.remove_sample = True
            if act == "pad":
                record["reason"] = "env_failed" if failed[key] else "stale"
                src_first = members[alias[key]][0]
                record["original_rollout_id"] = sample.rollout_id
                record["padded_from_index"] = samples[src_first].index
                sample.rollout_id = source_id[alias[key]]
                rewards[i] = rewards[src_first]
            if getattr(sample, "metadata", None) is None:
                sample.metadata = {}
            sample.metadata["ascend_staleness"] = record

    per_action = Counter(action[k] for k in keys)
    lag_hist = Counter(lag[k] for k in keys if not failed[k] and versions[k])
    stale = sum(1 for k in keys if not failed[k] and lag[k] > tau)
    report = {
        "samples": len(samples),
        "rollouts": len(keys),
        "trainer_version": trainer_version,
        "tau": tau,
        "kept": per_action["keep"],
        "padded": per_action["pad"],
        "dropped": len(keys) - per_action["keep"] - per_action["pad"],
        "stale": stale,
        "env_failed": sum(1 for k in keys if failed[k]) if s.group_rule else 0,
        "dropped_groups": dropped_groups,
        "dropped_group_members": per_action["drop_group"],
        "unversioned": unversioned,
        "max_lag": max(lag_hist) if lag_hist else 0,
        "lag_histogram": dict(sorted(lag_hist.items())),
    }
    with _lock:
        _state["report"] = report
    report_metrics(args, report)
    if report["kept"] != report["rollouts"] or unversioned:
        logger.info(
            "staleness: trainer version %d, tau %d: of %d rollouts kept %d, padded %d, dropped %d; invalid: %d stale "
            "(lag > tau), %d env-failed; %d groups dropped (< half valid) taking %d valid rollouts with them; "
            "%d without a weight version; lags %s",
            trainer_version, tau, len(keys), report["kept"], report["padded"], report["dropped"], stale,
            report["env_failed"], dropped_groups, report["dropped_group_members"], unversioned, report["lag_histogram"],
        )
    return raw_rewards, rewards


METRIC_PREFIX = "rollout/staleness_"
METRIC_KEYS = ("rollouts", "kept", "padded", "dropped", "stale", "env_failed", "dropped_groups", "unversioned",
               "max_lag", "trainer_version")


def report_metrics(args: Any, report: dict[str, Any]) -> dict[str, float]:
    """Put the counts of one call on slime's rollout metrics (``rollout/staleness_*``): a ``staleness
    <rollout_id>: {...}`` line in the RolloutManager's log and slime's trackers
    (:func:`slime_ascend.contracts.rollout_metrics.report`). Returns the metrics."""
    from .rollout_metrics import report as report_rollout

    return report_rollout(args, logger, "staleness", {METRIC_PREFIX + key: float(report[key]) for key in METRIC_KEYS})


def validate(args: Any, settings: Any) -> None:
    path = getattr(args, "custom_convert_samples_to_train_data_path", None)
    if path and path != "slime_ascend.hooks.convert_samples_to_train_data":
        raise SettingsError(
            f"plugin 'staleness' runs in slime's reward post-process, which the custom converter {path!r} "
            "bypasses. Fix: remove --custom-convert-samples-to-train-data-path"
        )

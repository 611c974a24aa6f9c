"""Sample-level off-policy control: policy-version staleness and the GLM-5 environment-failure rule.

Pure Python (lists and small dataclasses); the slime adapter maps ``Sample`` objects onto
:class:`SampleStatus` and applies the returned decisions.

Staleness (GLM-5 report §3.3): a response generated under weight versions w_0..w_k is dropped
when ``trainer_version - min(w) > tau``. slime records the versions as strings in
``Sample.weight_versions`` (``str(int)``, or zero-padded ``"000003"`` by the disk-delta updater); SGLang
reports ``"default"`` before any update, which we read as version 0.

Group rule (GLM-5): samples whose environment failed are excluded; a group with fewer than
``group_size / 2`` valid samples is dropped whole, otherwise it is padded. Here a sample is *valid*
iff it did not fail and is not stale (a stale sample weakens the group baseline the same way).

Padding (our choice [D]): every invalid slot of a kept group is filled with a copy of a valid sample of
the same group (round robin over the valid ones, in order) with its loss mask zeroed, so the group keeps
its shape (slime reshapes rewards to [-1, n_samples_per_prompt]) but padded slots train nothing.
Group baselines must then use the valid members only (the ``staleness`` plugin gives a padded slot its
source's ``rollout_id``, and the group normalisation counts each ``rollout_id`` once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "INITIAL_VERSION_ALIASES",
    "SampleStatus",
    "GroupFilterResult",
    "parse_weight_versions",
    "policy_lag",
    "staleness_keep",
    "filter_groups",
]

#: Version strings that mean "the initial weights" (version 0).
INITIAL_VERSION_ALIASES: frozenset[str] = frozenset({"default"})


def parse_weight_versions(versions: Sequence[str | int]) -> list[int]:
    """Parse slime's ``Sample.weight_versions`` (strings of ints, e.g. ``["3", "000004"]``) to ints.

    Raises ValueError naming the offending entry if it is not a non-negative integer or an alias in
    :data:`INITIAL_VERSION_ALIASES`.
    """
    if isinstance(versions, (str, bytes)):
        raise TypeError("weight_versions must be a list of version strings, not a single string")
    out: list[int] = []
    for i, v in enumerate(versions):
        if isinstance(v, bool):
            raise ValueError(f"weight_versions[{i}] = {v!r} is not a version")
        if isinstance(v, int):
            n = v
        elif isinstance(v, str):
            s = v.strip()
            if s in INITIAL_VERSION_ALIASES:
                n = 0
            elif s.isdigit() and s.isascii():
                n = int(s)
            else:
                raise ValueError(
                    f"weight_versions[{i}] = {v!r} is not an integer version string "
                    f"(expected e.g. '3' or '000003', or one of {sorted(INITIAL_VERSION_ALIASES)})"
                )
        else:
            raise ValueError(f"weight_versions[{i}] = {v!r} has type {type(v).__name__}; expected str or int")
        if n < 0:
            raise ValueError(f"weight_versions[{i}] = {v!r} is negative")
        out.append(n)
    return out


def policy_lag(trainer_version: int, weight_versions: Sequence[str | int]) -> int:
    """``trainer_version - min(weight_versions)``: how many updates behind the oldest producing policy is.

    Raises ValueError if no version is recorded or a version is newer than the trainer (bookkeeping bug).
    """
    if isinstance(trainer_version, bool) or not isinstance(trainer_version, int) or trainer_version < 0:
        raise ValueError(f"trainer_version must be an int >= 0, got {trainer_version!r}")
    parsed = parse_weight_versions(weight_versions)
    if not parsed:
        raise ValueError("weight_versions is empty: the sample has no recorded policy version")
    newest = max(parsed)
    if newest > trainer_version:
        raise ValueError(
            f"weight version {newest} is newer than trainer_version {trainer_version}; "
            "pass the version of the weights being trained"
        )
    return trainer_version - min(parsed)


def staleness_keep(lags: Sequence[int], tau: int) -> list[bool]:
    """Per-sample keep decision: lag <= tau (a sample with lag > tau is stale)."""
    if isinstance(tau, bool) or not isinstance(tau, int) or tau < 0:
        raise ValueError(f"tau must be an int >= 0, got {tau!r}")
    out = []
    for i, lag in enumerate(lags):
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
            raise ValueError(f"lags[{i}] must be an int >= 0, got {lag!r}")
        out.append(lag <= tau)
    return out


@dataclass(frozen=True)
class SampleStatus:
    """What the filter needs to know about one sample."""

    weight_versions: Sequence[str | int]
    env_failed: bool = False


@dataclass
class GroupFilterResult:
    """Decisions for ``groups`` (same nesting as the input).

    ``source[g][i]``: index within group g of the sample whose data fills slot i (i itself for a valid
    sample, another valid member for a padded slot), or None when the group is dropped.
    ``train[g][i]``: True iff the slot carries loss (valid sample of a kept group).
    ``keep_group[g]``: False iff group g is dropped.
    Counts: ``dropped_stale`` (samples with lag > tau, not env-failed), ``dropped_env_failed``,
    ``dropped_group`` (groups), ``dropped_group_samples`` (all slots of dropped groups, valid ones
    included), ``padded`` (invalid slots filled in kept groups). A stale or failed sample counts in its
    own counter *and* in ``padded`` or ``dropped_group_samples``.
    """

    source: list[list[int | None]] = field(default_factory=list)
    train: list[list[bool]] = field(default_factory=list)
    keep_group: list[bool] = field(default_factory=list)
    dropped_stale: int = 0
    dropped_env_failed: int = 0
    dropped_group: int = 0
    dropped_group_samples: int = 0
    padded: int = 0

    def counts(self) -> dict[str, int]:
        return {
            "dropped_stale": self.dropped_stale,
            "dropped_env_failed": self.dropped_env_failed,
            "dropped_group": self.dropped_group,
            "dropped_group_samples": self.dropped_group_samples,
            "padded": self.padded,
        }


def filter_groups(
    groups: Sequence[Sequence[SampleStatus]],
    trainer_version: int,
    tau: int | None,
    group_size: int | None = None,
) -> GroupFilterResult:
    """Apply staleness (``tau``; None disables it) and the GLM-5 group rule to each group.

    A group is kept iff ``2 * n_valid >= group_size`` (``group_size`` defaults to each group's own
    length; pass the configured n_samples_per_prompt when groups can arrive short) and ``n_valid > 0``.
    Env-failed samples are not checked for staleness (their versions may be missing).
    """
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"group_size must be an int >= 1 or None, got {group_size!r}")
    res = GroupFilterResult()
    for g, group in enumerate(groups):
        size = len(group) if group_size is None else group_size
        if group_size is not None and len(group) > group_size:
            raise ValueError(f"group {g} has {len(group)} samples, more than group_size={group_size}")
        valid: list[bool] = []
        for s in group:
            if s.env_failed:
                res.dropped_env_failed += 1
                valid.append(False)
                continue
            if tau is not None and not staleness_keep([policy_lag(trainer_version, s.weight_versions)], tau)[0]:
                res.dropped_stale += 1
                valid.append(False)
                continue
            valid.append(True)
        valid_idx = [i for i, v in enumerate(valid) if v]
        n_valid = len(valid_idx)
        if n_valid == 0 or 2 * n_valid < size:
            res.keep_group.append(False)
            res.source.append([None] * len(group))
            res.train.append([False] * len(group))
            res.dropped_group += 1
            res.dropped_group_samples += len(group)
            continue
        src: list[int | None] = []
        j = 0
        for i, v in enumerate(valid):
            if v:
                src.append(i)
            else:
                src.append(valid_idx[j % n_valid])
                j += 1
        res.keep_group.append(True)
        res.source.append(src)
        res.train.append(list(valid))
        res.padded += len(group) - n_valid
    return res


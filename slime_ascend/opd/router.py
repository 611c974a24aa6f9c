"""Hard routing of samples to teachers by domain label (MOPD: one teacher per sample, no averaging)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from slime_ascend.opd.teachers import TeacherSpec

__all__ = ["RouteDecision", "RoutingError", "DomainRouter", "order_by_teacher", "group_by_teacher"]

T = TypeVar("T")


class RoutingError(KeyError):
    """A sample has no route (missing or unknown domain label and no default teacher)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class RouteDecision:
    """One routing decision, kept for logging and audits."""

    sample_id: Hashable | None
    domain: str | None
    teacher: str
    defaulted: bool


class DomainRouter:
    """Route each sample to the teacher owning its domain label.

    Args:
        teachers: parsed teacher specs (domain labels unique across teachers).
        domain_key: metadata key holding the domain label (default ``"domain"``).
        default_teacher: teacher for samples whose label is missing or unknown; without one,
            such samples raise :class:`RoutingError`.
        default_coef: coefficient of teachers whose spec has no ``coef``.
        max_decisions: bound on the recorded decision log (oldest dropped).
    """

    def __init__(
        self,
        teachers: Sequence[TeacherSpec],
        *,
        domain_key: str = "domain",
        default_teacher: str | None = None,
        default_coef: float = 1.0,
        max_decisions: int = 100_000,
    ) -> None:
        if not teachers:
            raise ValueError("DomainRouter needs at least one teacher")
        self.teachers: dict[str, TeacherSpec] = {t.name: t for t in teachers}
        self.domain_key = domain_key
        self._by_domain: dict[str, str] = {}
        for t in teachers:
            for d in t.domains:
                if d in self._by_domain:
                    raise ValueError(f"domain {d!r} routed to both {self._by_domain[d]!r} and {t.name!r}")
                self._by_domain[d] = t.name
        if default_teacher is not None and default_teacher not in self.teachers:
            raise ValueError(f"default_teacher {default_teacher!r} is not a configured teacher {sorted(self.teachers)}")
        self.default_teacher = default_teacher
        self.default_coef = float(default_coef)
        self.max_decisions = max_decisions
        self.counts: Counter[str] = Counter()
        self.defaulted_count = 0
        self.decisions: list[RouteDecision] = []

    def teacher_for_domain(self, domain: str | None) -> tuple[str, bool]:
        """``(teacher name, defaulted)`` for a label, without recording anything."""
        if domain is not None and domain in self._by_domain:
            return self._by_domain[domain], False
        if self.default_teacher is not None:
            return self.default_teacher, True
        if domain is None:
            raise RoutingError(
                f"sample metadata has no {self.domain_key!r} label and no default_teacher is configured"
            )
        raise RoutingError(
            f"domain {domain!r} has no teacher (known domains: {sorted(self._by_domain)}); "
            "add it to a teacher's 'domains' or configure default_teacher"
        )

    def route(self, metadata: Mapping[str, Any] | None, sample_id: Hashable | None = None) -> TeacherSpec:
        """Route one sample by ``metadata[domain_key]``; records the decision and count."""
        domain = None if metadata is None else metadata.get(self.domain_key)
        if domain is not None and not isinstance(domain, str):
            domain = str(domain)
        try:
            name, defaulted = self.teacher_for_domain(domain)
        except RoutingError as e:
            raise RoutingError(f"sample {sample_id!r}: {e}") from None
        self.counts[name] += 1
        self.defaulted_count += int(defaulted)
        self.decisions.append(RouteDecision(sample_id, domain, name, defaulted))
        if len(self.decisions) > self.max_decisions:
            del self.decisions[: len(self.decisions) - self.max_decisions]
        return self.teachers[name]

    def route_many(self, metadatas: Iterable[Mapping[str, Any] | None]) -> list[str]:
        """Route a batch; returns teacher names in input order (sample ids = positions)."""
        return [self.route(m, sample_id=i).name for i, m in enumerate(metadatas)]

    def coef_for(self, name: str) -> float:
        """The OPD coefficient of teacher ``name`` (its ``coef`` or ``default_coef``)."""
        return self.teachers[name].effective_coef(self.default_coef)

    def order_by_teacher(
        self,
        items: Sequence[T],
        metadata_of: Callable[[T], Mapping[str, Any] | None] = lambda s: getattr(s, "metadata", None),
        *,
        schedule: Sequence[str] | None = None,
        current: str | None = None,
    ) -> list[tuple[str, list[T]]]:
        """Route ``items`` and group them per teacher (see :func:`group_by_teacher`)."""
        pairs = [(it, self.route(metadata_of(it), sample_id=i).name) for i, it in enumerate(items)]
        groups = group_by_teacher(pairs, lambda p: p[1], schedule=schedule, current=current)
        return [(name, [p[0] for p in block]) for name, block in groups]

    def stats(self) -> dict[str, Any]:
        """Per-teacher counts and number of defaulted routes since the last reset."""
        return {"counts": dict(self.counts), "defaulted": self.defaulted_count, "total": sum(self.counts.values())}


def group_by_teacher(
    items: Iterable[T],
    teacher_of: Callable[[T], str],
    *,
    schedule: Sequence[str] | None = None,
    current: str | None = None,
) -> list[tuple[str, list[T]]]:
    """Group items into one contiguous block per teacher, in switch order.

    Order of blocks: ``current`` (the resident teacher, so it needs no switch) first, then the
    teachers of ``schedule`` in its order, then any others by first appearance. Items keep their
    relative order within a block. Scoring the blocks in order switches into each teacher at most
    once per step: ``#switches = #blocks - (1 if current is among them)``.
    """
    blocks: dict[str, list[T]] = {}
    for it in items:
        blocks.setdefault(teacher_of(it), []).append(it)
    rank: dict[str, int] = {}
    if current is not None:
        rank[current] = -1
    for i, name in enumerate(schedule or ()):
        rank.setdefault(name, i)
    big = len(schedule or ()) + 1
    first_seen = {name: i for i, name in enumerate(blocks)}
    ordered = sorted(blocks, key=lambda n: (rank.get(n, big), first_seen[n]))
    return [(n, blocks[n]) for n in ordered]


def order_by_teacher(
    items: Iterable[T],
    teacher_of: Callable[[T], str],
    *,
    schedule: Sequence[str] | None = None,
    current: str | None = None,
) -> list[T]:
    """Flattened :func:`group_by_teacher`: items reordered so each teacher's items are contiguous."""
    return [it for _, block in group_by_teacher(items, teacher_of, schedule=schedule, current=current) for it in block]

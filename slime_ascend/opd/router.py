"""Hard routing of samples to teachers by domain label (MOPD: one teacher per sample, no averaging)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from slime_ascend.opd.teachers import TeacherSpec

__all__ = ["RoutingError", "DomainRouter"]


class RoutingError(KeyError):
    """A sample has no route (missing or unknown domain label and no default teacher)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class DomainRouter:
    """Route each sample to the teacher owning its domain label.

    Args:
        teachers: teacher specs from :func:`~slime_ascend.opd.teachers.parse_teachers` (at least one;
            each domain label belongs to one teacher).
        domain_key: metadata key holding the domain label (default ``"domain"``).
        default_teacher: teacher for samples whose label is missing or unknown; without one,
            such samples raise :class:`RoutingError`.
        default_coef: coefficient of teachers whose spec has no ``coef``.
    """

    def __init__(
        self,
        teachers: Sequence[TeacherSpec],
        *,
        domain_key: str = "domain",
        default_teacher: str | None = None,
        default_coef: float = 1.0,
    ) -> None:
        self.teachers: dict[str, TeacherSpec] = {t.name: t for t in teachers}
        self.domain_key = domain_key
        self._by_domain: dict[str, str] = {d: t.name for t in teachers for d in t.domains}
        if default_teacher is not None and default_teacher not in self.teachers:
            raise ValueError(f"default_teacher {default_teacher!r} is not a configured teacher {sorted(self.teachers)}")
        self.default_teacher = default_teacher
        self.default_coef = float(default_coef)
        self.counts: Counter[str] = Counter()
        self.defaulted_count = 0

    def route(self, metadata: Mapping[str, Any] | None, sample_id: Hashable | None = None) -> TeacherSpec:
        """Route one sample by ``metadata[domain_key]``; counts it."""
        domain = None if metadata is None else metadata.get(self.domain_key)
        if domain is not None and not isinstance(domain, str):
            domain = str(domain)
        if domain in self._by_domain:
            name = self._by_domain[domain]
        elif self.default_teacher is not None:
            name = self.default_teacher
            self.defaulted_count += 1
        elif domain is None:
            raise RoutingError(
                f"sample {sample_id!r}: sample metadata has no {self.domain_key!r} label and no default_teacher is "
                "configured"
            )
        else:
            raise RoutingError(
                f"sample {sample_id!r}: domain {domain!r} has no teacher (known domains: {sorted(self._by_domain)}); "
                "add it to a teacher's 'domains' or configure default_teacher"
            )
        self.counts[name] += 1
        return self.teachers[name]

    def coef_for(self, name: str) -> float:
        """The OPD coefficient of teacher ``name`` (its ``coef`` or ``default_coef``)."""
        return self.teachers[name].effective_coef(self.default_coef)

    def stats(self) -> dict[str, Any]:
        """Per-teacher counts and number of defaulted routes so far."""
        return {"counts": dict(self.counts), "defaulted": self.defaulted_count, "total": sum(self.counts.values())}


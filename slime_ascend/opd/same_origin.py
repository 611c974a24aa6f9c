"""Same-origin check: initial per-token KL between each teacher and the student.

MOPD teachers should be domain-RL experts grown from the student's own SFT checkpoint; a
"foreign" teacher (stronger but differently distributed) raised the initial per-token KL about
5x and caused entropy contraction / top-k collapse. This module estimates the per-token KL and flags
teachers whose KL is far above the others' (the opd plugin measures it on the first rollout's samples,
each teacher on the samples routed to it).

KL(S || T) is estimated on the student's sampled tokens from the two log-probs of each token,
with ``r = pi_T / pi_S``: ``k1 = log pi_S - log pi_T`` (unbiased, can be negative per token) or
``k3 = r - 1 - log r`` (unbiased, non-negative, lower variance; the default).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

__all__ = ["TeacherKL", "SameOriginReport", "per_token_kl", "report_from_kls"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TeacherKL:
    name: str
    kl: float  # masked mean per-token KL(student || teacher)
    ratio: float | None  # kl / median KL of the *other* teachers (None with a single teacher)
    flagged: bool
    tokens: int


@dataclass
class SameOriginReport:
    teachers: dict[str, TeacherKL]
    threshold_ratio: float
    estimator: str
    warnings: list[str] = field(default_factory=list)

    @property
    def flagged(self) -> list[str]:
        return [n for n, t in self.teachers.items() if t.flagged]

    def to_dict(self) -> dict:
        return {
            "threshold_ratio": self.threshold_ratio,
            "estimator": self.estimator,
            "teachers": {n: vars(t).copy() for n, t in self.teachers.items()},
            "flagged": self.flagged,
            "warnings": list(self.warnings),
        }


def per_token_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(S || T) estimate from sampled-token log-probs (``"k1"`` or ``"k3"``)."""
    if student_log_probs.shape != teacher_log_probs.shape:
        raise ValueError(
            f"student log-probs {tuple(student_log_probs.shape)} and teacher log-probs "
            f"{tuple(teacher_log_probs.shape)} must have the same shape"
        )
    log_r = teacher_log_probs.float().to(student_log_probs.device) - student_log_probs.float()
    if estimator == "k1":
        return -log_r
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"estimator must be 'k1' or 'k3', got {estimator!r}")


def report_from_kls(
    kls: Mapping[str, float],
    tokens: Mapping[str, int] | None = None,
    *,
    threshold_ratio: float = 3.0,
    max_kl: float | None = None,
    estimator: str = "k3",
    warn: bool = True,
) -> SameOriginReport:
    """Flag outliers among per-teacher mean KLs already measured (e.g. each teacher on its own
    routed samples): ratio to the median of the *other* teachers (leave-one-out, so two teachers can
    flag each other's outlier), and optional ``max_kl``."""
    if threshold_ratio <= 1.0:
        raise ValueError(f"threshold_ratio must be > 1, got {threshold_ratio}")
    report = SameOriginReport({}, threshold_ratio, estimator)
    for name, kl in kls.items():
        others = [v for k, v in kls.items() if k != name]
        ratio = None
        if others:
            med = statistics.median(others)
            ratio = kl / med if med > 0 else (math.inf if kl > 0 else 1.0)
        over_ratio = ratio is not None and ratio > threshold_ratio
        flagged = over_ratio or (max_kl is not None and kl > max_kl)
        report.teachers[name] = TeacherKL(name, kl, ratio, flagged, int((tokens or {}).get(name, 0)))
        if flagged:
            why = f"{ratio:.2f}x the median of the other teachers" if over_ratio else f"above max_kl={max_kl}"
            msg = (
                f"teacher {name!r}: initial per-token KL to the student {kl:.4g} is {why}; it may not be "
                "same-origin (MOPD saw ~5x KL from a foreign teacher, with entropy contraction)"
            )
            report.warnings.append(msg)
            if warn:
                logger.warning(msg)
    return report

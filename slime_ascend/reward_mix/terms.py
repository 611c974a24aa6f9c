"""Ready-made terms for ``ascend_reward_components`` / ``ascend_reward_penalties`` (``path:``)."""

from __future__ import annotations

from typing import Any


def response_length(args: Any, sample: Any, budget: int = 0) -> float:
    """Penalty: response tokens past ``budget``, as a fraction of ``--rollout-max-response-len`` (0 within
    the budget)."""
    length = int(getattr(sample, "response_length", 0) or 0)
    cap = int(getattr(args, "rollout_max_response_len", 0) or 0) or max(length, 1)
    return max(0, length - int(budget)) / cap


def truncated(args: Any, sample: Any) -> float:
    """Penalty: 1 when the response was cut at the length limit (slime's TRUNCATED status), else 0."""
    status = getattr(sample, "status", None)
    return 1.0 if getattr(status, "name", status) in ("TRUNCATED", "truncated") else 0.0

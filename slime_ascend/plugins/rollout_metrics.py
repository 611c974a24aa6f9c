"""Rollout-side plugin counts on slime's own rollout metric path.

slime's RolloutManager logs each rollout's metrics as one ``perf <rollout_id>: {'rollout/...': ...}`` line
(``slime.observability.rollout_metrics.log_rollout_data``) and sends them to its trackers (wandb /
tensorboard) with ``logging_utils.log`` at the rollout step. It does so before the reward post-process,
where ``staleness`` and ``tito`` run, so those plugins report their counts the same way themselves:
one ``<name> <rollout_id>: {...}`` line in the RolloutManager's log and, when slime tracks metrics, the
same keys at slime's rollout step.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

__all__ = ["current_rollout_id", "report"]


def current_rollout_id() -> int | None:
    """The rollout slime's RolloutManager is generating (``slime.rollout.sample_hooks`` keeps it), or None."""
    module = sys.modules.get("slime.rollout.sample_hooks")
    value = getattr(module, "_current_rollout_id", None)
    return value if isinstance(value, int) else None


def report(args: Any, logger: logging.Logger, name: str, metrics: dict[str, float]) -> dict[str, float]:
    """Log ``metrics`` (``rollout/*`` keys) as ``<name> <rollout_id>: {...}`` and hand them to slime's
    trackers when it has any. Returns ``metrics``."""
    rollout_id = current_rollout_id()
    logger.info("%s %s: %s", name, rollout_id if rollout_id is not None else "-", metrics)
    if rollout_id is not None and (getattr(args, "use_wandb", False) or getattr(args, "use_tensorboard", False)):
        from slime.observability import logging_utils
        from slime.observability.metric_utils import compute_rollout_step

        logging_utils.log(args, {**metrics, "rollout/step": compute_rollout_step(args, rollout_id)},
                          step_key="rollout/step")
    return metrics

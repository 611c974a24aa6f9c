"""Access to slime's ``Sample`` with a small stand-in for environments without slime.

``get_sample_class()`` returns ``slime.utils.types.Sample`` when slime is importable. Otherwise it
returns :class:`FallbackSample`, a mirror of slime's Sample for environments without slime: same
field names and meanings for the subset our plugins read and write, the same ``Status`` values,
``get_reward_value`` and ``to_dict``/``from_dict``. It is not a full copy: multimodal, top-p replay,
routed-experts, speculative and prefix-cache fields are absent.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

__all__ = ["FallbackSample", "get_sample_class"]


@dataclass
class FallbackSample:
    """Mirror of slime's ``Sample`` (``slime/utils/types.py``) for environments without slime.

    ``tokens`` holds prompt + response token ids; the response is the last ``response_length`` of
    them. ``loss_mask`` and ``rollout_log_probs`` are response-aligned (``None`` mask = all ones).
    Siblings split from one rollout (e.g. compaction segments) share ``rollout_id``; ``None`` means
    "use ``index``" downstream.
    """

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None

    def get_reward_value(self, args: Any) -> float:
        """The scalar reward; selects ``reward[args.reward_key]`` when ``args.reward_key`` is set."""
        key = getattr(args, "reward_key", None)
        return self.reward if not key else self.reward[key]

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def to_dict(self) -> dict[str, Any]:
        value = self.__dict__.copy()
        value["status"] = self.status.value
        return value

    @staticmethod
    def from_dict(data: dict[str, Any]) -> FallbackSample:
        data = dict(data)
        data["status"] = FallbackSample.Status(data["status"])
        names = {f.name for f in fields(FallbackSample)}
        sample = FallbackSample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample


@functools.cache
def get_sample_class() -> type:
    """slime's ``Sample`` when importable, else :class:`FallbackSample`."""
    try:
        from slime.utils.types import Sample
    except ImportError:
        return FallbackSample
    return Sample

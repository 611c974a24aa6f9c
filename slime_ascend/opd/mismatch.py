"""What the teacher/student compatibility check reports: one field that differs, and the special-token roles
compared. Shared by the checkpoint comparison (:mod:`.compat`) and the engine probe (:mod:`.engine_probe`)."""

from __future__ import annotations

from typing import Any, NamedTuple

SPECIAL_ROLES = ("bos_token", "eos_token", "pad_token", "unk_token")


class Mismatch(NamedTuple):
    """One field that differs: ``(teacher, field, student value, teacher value)``; ``detail`` (set by
    the engine probe, whose values are answers rather than fields) says how, in words."""

    teacher: str
    field: str
    student: Any
    teacher_value: Any
    detail: str | None = None

"""Teacher specifications for multi-teacher on-policy distillation (MOPD).

A ``teachers`` config is a list of dicts (typically YAML), one per teacher::

    teachers:
      - name: math
        checkpoint_dir: /ckpt/math-rl
        domains: [math]
        coef: 1.0                 # optional, per-teacher OPD coefficient
        tokenizer_revision: abc1  # optional, must equal the student's when both are known
        vocab_size: 151936        # optional, else read from checkpoint_dir/config.json
        url: http://host:30000    # optional, an external scoring endpoint
        compat_check: warn        # optional: strict | warn | off, overrides ascend_opd_compat_check

:func:`parse_teachers` validates it; errors name the teacher and the field. Compatibility with the
student (vocabulary size, special tokens, tokenizer, chat template) is :mod:`.compat`'s
(:func:`~slime_ascend.opd.compat.check_teacher_compatible`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "TeacherSpec",
    "TeacherConfigError",
    "TeacherMismatchError",
    "parse_teachers",
    "NAME_RE",
]

_FIELDS = {"name", "checkpoint_dir", "domains", "coef", "tokenizer_revision", "vocab_size", "url", "compat_check"}
COMPAT_MODES = ("strict", "warn", "off")

#: A teacher name is used as a directory name under the stage directory: no separators, no ``.``/``..``.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class TeacherConfigError(ValueError):
    """A ``teachers`` entry is malformed."""


class TeacherMismatchError(ValueError):
    """A teacher's vocabulary or tokenizer differs from the student's."""


@dataclass(frozen=True)
class TeacherSpec:
    """One routed teacher: where its weights live and which domains it scores."""

    name: str
    checkpoint_dir: Path
    domains: tuple[str, ...]
    coef: float | None = None
    tokenizer_revision: str | None = None
    vocab_size: int | None = None
    url: str | None = None
    compat_check: str | None = None  # strict | warn | off; None: ascend_opd_compat_check

    def effective_coef(self, default: float = 1.0) -> float:
        """``coef`` if set, else ``default``."""
        return default if self.coef is None else self.coef

    def to_dict(self) -> dict[str, Any]:
        """Plain, YAML/JSON/ray-serialisable form accepted back by :func:`parse_teachers`."""
        out: dict[str, Any] = {
            "name": self.name,
            "checkpoint_dir": str(self.checkpoint_dir),
            "domains": list(self.domains),
        }
        for key in ("coef", "tokenizer_revision", "vocab_size", "url", "compat_check"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


def _err(idx: int, name: str | None, fld: str, msg: str) -> TeacherConfigError:
    who = f"teacher {name!r}" if name else f"teachers[{idx}]"
    return TeacherConfigError(f"{who}: field {fld!r}: {msg}")


def check_name(idx: int, name: Any) -> None:
    """Raise :class:`TeacherConfigError` unless ``name`` is safe as one directory name (see NAME_RE)."""
    if not isinstance(name, str) or not name.strip():
        raise _err(idx, None, "name", "required non-empty string")
    if not NAME_RE.fullmatch(name):
        raise TeacherConfigError(
            f"teachers[{idx}]: field 'name': {name!r} is not a valid teacher name (it becomes a directory under "
            "ascend_opd_stage_dir). Fix: use 1-64 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit"
        )


def _parse_one(idx: int, raw: Any) -> TeacherSpec:
    if isinstance(raw, TeacherSpec):
        check_name(idx, raw.name)
        return raw
    if not isinstance(raw, Mapping):
        raise TeacherConfigError(f"teachers[{idx}]: expected a mapping, got {type(raw).__name__}")
    name = raw.get("name")
    check_name(idx, name)
    unknown = set(raw) - _FIELDS
    if unknown:
        raise _err(idx, name, sorted(unknown)[0], f"unknown field; allowed fields are {sorted(_FIELDS)}")
    ckpt = raw.get("checkpoint_dir")
    if not isinstance(ckpt, (str, Path)) or not str(ckpt):
        raise _err(idx, name, "checkpoint_dir", "required path string")
    domains = raw.get("domains")
    if isinstance(domains, str):
        domains = [domains]
    if not isinstance(domains, (list, tuple)) or not domains:
        raise _err(idx, name, "domains", "required non-empty list of domain labels")
    for d in domains:
        if not isinstance(d, str) or not d:
            raise _err(idx, name, "domains", f"domain labels must be non-empty strings, got {d!r}")
    if len(set(domains)) != len(domains):
        raise _err(idx, name, "domains", f"duplicate domain labels in {list(domains)}")
    coef = raw.get("coef")
    if coef is not None:
        if isinstance(coef, bool) or not isinstance(coef, (int, float)):
            raise _err(idx, name, "coef", f"must be a number, got {coef!r}")
        if not coef >= 0:
            raise _err(idx, name, "coef", f"must be >= 0, got {coef}")
        coef = float(coef)
    rev = raw.get("tokenizer_revision")
    if rev is not None and (not isinstance(rev, str) or not rev):
        raise _err(idx, name, "tokenizer_revision", f"must be a non-empty string, got {rev!r}")
    vocab = raw.get("vocab_size")
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= 0):
        raise _err(idx, name, "vocab_size", f"must be a positive integer, got {vocab!r}")
    url = raw.get("url")
    if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
        raise _err(idx, name, "url", f"must be an http(s) URL, got {url!r}")
    compat = raw.get("compat_check")
    if compat is not None and compat not in COMPAT_MODES:
        raise _err(idx, name, "compat_check", f"must be one of {list(COMPAT_MODES)}, got {compat!r}")
    return TeacherSpec(
        name=name,
        checkpoint_dir=Path(ckpt),
        domains=tuple(domains),
        coef=coef,
        tokenizer_revision=rev,
        vocab_size=vocab,
        url=url,
        compat_check=compat,
    )


def parse_teachers(raw: Sequence[Mapping[str, Any] | TeacherSpec] | Mapping[str, Any]) -> list[TeacherSpec]:
    """Validate a ``teachers`` list (or a mapping with a ``teachers`` key) into specs.

    Checks: required fields and types, unique names, and that each domain label belongs to exactly
    one teacher (MOPD routes, it never averages teachers).
    """
    if isinstance(raw, Mapping):
        if "teachers" not in raw:
            raise TeacherConfigError("config mapping has no 'teachers' key; give a list of teacher dicts")
        raw = raw["teachers"]
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Iterable):
        raise TeacherConfigError(f"'teachers' must be a list of mappings, got {type(raw).__name__}")
    specs = [_parse_one(i, r) for i, r in enumerate(raw)]
    if not specs:
        raise TeacherConfigError("'teachers' is empty; configure at least one teacher")
    seen: dict[str, int] = {}
    owner: dict[str, str] = {}
    for i, s in enumerate(specs):
        if s.name in seen:
            raise _err(i, s.name, "name", f"duplicate teacher name (also teachers[{seen[s.name]}])")
        seen[s.name] = i
        for d in s.domains:
            if d in owner:
                raise _err(i, s.name, "domains", f"domain {d!r} is already routed to teacher {owner[d]!r}")
            owner[d] = s.name
    return specs

"""The reward mix, pure: the declared components and penalties, and how one sample's values combine.

A *term* is ``{name, path | rm_type, weight (component) | lambda (penalty), kind?, kwargs?}``:

* ``path``: a function ``(args, sample, **kwargs) -> float`` (sync or async), e.g. a judge or an
  outcome-model client (ready-made: :func:`slime_ascend.reward_mix.orm.score`, a reward model over SGLang's
  ``/classify`` or slime's ``--rm-url`` protocol; :func:`slime_ascend.reward_mix.judge.verdict`, a generative
  judge over ``/generate``); ``rm_type``: one of slime's own rule-based reward models (``--rm-type`` names:
  math, deepscaler, dapo, f1, remote_rm, ...), applied with that type whatever ``--rm-type`` says;
* ``kind`` (components): ``rule``, ``outcome_model`` or ``judge`` — a label the metrics and the sample
  carry (defaults: ``rule`` with ``rm_type``, ``outcome_model`` with ``orm.score``, ``judge`` with any other
  ``path``);
* ``weight`` (components, default 1) / ``lambda`` (penalties, default 1, >= 0): R = sum w R_k - sum
  lambda P_j.

A term that raises, returns a non-number, NaN or an infinity, or whose weighted sum overflows, *fails*
the sample: its reward is not a number to learn from (:func:`combine` returns None with the reason),
never a low score.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..plugins.settings import SettingsError

KINDS = ("rule", "outcome_model", "judge")
# the ready-made model terms' kinds when a term does not say (judge.verdict is a judge, the default of a path)
DEFAULT_KINDS = {"slime_ascend.reward_mix.orm.score": "outcome_model"}


class MixError(SettingsError):
    """A term of ``ascend_reward_components`` / ``ascend_reward_penalties`` is not usable (a settings error:
    one line at ``parse_args``)."""


@dataclasses.dataclass(frozen=True)
class Term:
    name: str
    coef: float  # weight (component) or lambda (penalty)
    kind: str
    path: str | None = None
    rm_type: str | None = None
    kwargs: tuple[tuple[str, Any], ...] = ()


def parse_terms(value: Any, key: str, penalty: bool = False) -> tuple[Term, ...]:
    """Validate one setting's list of terms; raises :class:`MixError` naming the setting and the fix."""
    if value in (None, [], {}):
        return ()
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise MixError(f"{key} must be a list of {{name, path | rm_type, ...}}, got {type(value).__name__}")
    out: list[Term] = []
    coef_key = "lambda" if penalty else "weight"
    for i, raw in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(raw, Mapping):
            raise MixError(f"{where} must be a mapping like {{name: correctness, rm_type: math}}, got {raw!r}")
        unknown = set(raw) - {"name", "path", "rm_type", coef_key, "kind", "kwargs"}
        if unknown:
            raise MixError(f"{where} has unknown keys {sorted(unknown)} (allowed: name, path, rm_type, {coef_key}, "
                           "kind, kwargs)")
        name = raw.get("name")
        if not isinstance(name, str) or not name.replace("_", "").replace("-", "").isalnum():
            raise MixError(f"{where}.name must be a word (letters, digits, _ or -), got {name!r}")
        path, rm_type = raw.get("path"), raw.get("rm_type")
        if (path is None) == (rm_type is None):
            raise MixError(f"{where} ({name}) needs exactly one of path (a function module.fn) or rm_type (one of "
                           "slime's --rm-type names)")
        for label, text in (("path", path), ("rm_type", rm_type)):
            if text is not None and (not isinstance(text, str) or not text.strip()):
                raise MixError(f"{where}.{label} must be a non-empty string, got {text!r}")
        if path is not None and "." not in path:
            raise MixError(f"{where}.path {path!r} must be a dotted function path, e.g. my_pkg.judges.score")
        coef = raw.get(coef_key, 1.0)
        if isinstance(coef, bool) or not isinstance(coef, int | float) or not math.isfinite(coef) or (
                penalty and coef < 0):
            raise MixError(f"{where}.{coef_key} must be a finite number{' >= 0' if penalty else ''}, got {coef!r}")
        kind = raw.get("kind", "penalty" if penalty else ("rule" if rm_type else DEFAULT_KINDS.get(path, "judge")))
        if not penalty and kind not in KINDS:
            raise MixError(f"{where}.kind must be one of {', '.join(KINDS)}, got {kind!r}")
        kwargs = raw.get("kwargs") or {}
        if not isinstance(kwargs, Mapping):
            raise MixError(f"{where}.kwargs must be a mapping, got {kwargs!r}")
        out.append(Term(name, float(coef), kind, path, rm_type, tuple(sorted(kwargs.items()))))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise MixError(f"{key} names a term twice: {names}")
    return tuple(out)


def as_number(value: Any) -> float | None:
    """A term's value as a finite float, else None. slime's rule rewards may come as dicts with a
    ``score``; booleans count as 0/1."""
    if isinstance(value, Mapping):
        value = value.get("score", value.get("reward"))
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def combine(components: Sequence[Term], penalties: Sequence[Term], values: Mapping[str, Any]
            ) -> tuple[float | None, str | None]:
    """``(R, None)``, or ``(None, reason)`` when a term has no usable value (``values[name]`` may hold
    the exception a term raised)."""
    total = 0.0
    for terms, sign in ((components, 1.0), (penalties, -1.0)):
        for term in terms:
            value = values.get(term.name)
            if isinstance(value, BaseException):
                text = " ".join(str(value).split())[:200]
                return None, f"{term.name}: {type(value).__name__}: {text}" if text else f"{term.name}: {type(value).__name__}"
            number = as_number(value)
            if number is None:
                return None, f"{term.name}: not a finite number ({value!r})"
            total += sign * term.coef * number
    if not math.isfinite(total):  # finite terms whose weighted sum overflows
        return None, f"the weighted sum overflows ({total!r})"
    return total, None

"""Teacher/student compatibility, checked at start: may this teacher score the student's tokens?

In OPD the teacher never tokenizes: it scores the *student's* token ids (``/generate`` with
``input_ids``), so every id must mean the same string to both models, the teacher must have been
trained on the same canonical tokenization (merges, normaliser, pre-tokenizer) and on the same chat
format, and its log-probs must normalise over the same rows. A mismatch does not crash anything: it
silently trains the student toward a teacher that is scoring gibberish. This module finds it first.

Pure (no slime, no Ray); ``transformers`` is imported only to read a tokenizer.

Fingerprint (:func:`fingerprint_dir`, one checkpoint directory; :class:`Fingerprint`):

* ``vocab_size``: ``config.json``'s ``vocab_size`` (or its ``text_config``'s): the rows of the
  embedding / LM head, i.e. the width of the distribution the log-probs normalise over.
* ``tokenizer_len``: ``len(tokenizer)``, the ids the tokenizer can produce (base vocabulary plus
  added tokens).
* ``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token``: each as ``(id, text)`` (None: unset).
* ``special_tokens``: every added token marked special (``added_tokens_decoder``), as ``(id, text)``
  pairs: the chat-control tokens (``<|im_start|>``, ``<|im_end|>``, tool tags, ...).
* ``tokenizer``: the tokenizer as it encodes: ``enc:<hash>`` of the fast tokenizer's model (vocab and
  merges), normaliser, pre-tokenizer, post-processor and added tokens (the backend's own serialisation,
  so formatting and unrelated ``tokenizer_config.json`` keys such as ``model_max_length`` do not count;
  a slow tokenizer hashes its vocabulary and model files). When no tokenizer can be loaded it is
  ``files:<hash>`` of the tokenizer files, ``slime-ascend tito-fingerprint``'s ``tok`` part.
* ``chat_template``: ``tpl:<hash>`` of the chat template as transformers reads it (``chat_template.jinja``,
  ``chat_template.json``, else ``tokenizer_config.json``'s, so where it is stored does not count);
  ``tpl:none`` when there is none.
* ``revision``: the ``tito`` revision (``slime-ascend tito-fingerprint``), compared with a teacher
  entry's declared ``tokenizer_revision``.

Rules (:func:`compare`, strict by design; every field known on both sides must be equal):

* ``vocab_size`` equal. A teacher with a *larger* (padded) embedding table is refused too: its
  log-probs normalise over rows the student can never produce, and in top-k mode it can return ids
  outside the student's vocabulary. A deliberately padded teacher with the identical tokenizer is the
  case for the opt-out (``compat_check: warn`` on that teacher).
* ``tokenizer_len``, the four special tokens (id *and* text) and the set of special tokens equal.
* ``tokenizer`` equal: ``enc:`` against ``enc:``; when a side's tokenizer could not be loaded, both
  sides' tokenizer files are compared (``files:`` against ``files:``).
* ``chat_template`` equal (the student's prompt format is what the teacher scores).
* A teacher's declared ``vocab_size`` replaces the one read from its files; a declared
  ``tokenizer_revision`` must equal the student's tito revision.
* A field unknown on either side is not a mismatch: it is listed as *not checked* with the reason
  (:attr:`Report.unchecked`), which the caller logs.

Opt-out: ``compat_check`` per teacher (in ``ascend_opd_teachers``) or ``ascend_opd_compat_check`` for
all: ``strict`` (refuse to start), ``warn`` (log the mismatches and go on), ``off`` (skip, no reads).

A teacher served at a URL whose ``checkpoint_dir`` is not a local directory is asked at its engine, all
its requests under one deadline (``timeout_s``): ``/model_info`` and ``/server_info`` (``model_path``,
``tokenizer_path``; ``vocab_size`` where the engine reports it, as the torch engine does); a
``tokenizer_path`` or ``model_path`` that is a directory here is then fingerprinted like a checkpoint.
Otherwise the engine is probed (:mod:`.engine_probe`: it tokenizes the student's special tokens and fixed
texts, applies its chat template to a fixed conversation, scores a short prefix, and shows its vocabulary
bound), and those answers are compared with the student's tokenizer's. An engine that does not answer
within the deadline is refused like a mismatch (``strict``; ``warn`` logs it), naming the teacher and
the address.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..tito.fingerprint import TitoError
from ..tito.fingerprint import tokenizer_fingerprint as tito_fingerprint
from .mismatch import SPECIAL_ROLES, Mismatch
from .teachers import COMPAT_MODES as MODES
from .teachers import TeacherMismatchError, TeacherSpec

__all__ = [
    "MODES",
    "FIELDS",
    "Fingerprint",
    "Mismatch",
    "Report",
    "fingerprint_dir",
    "compare",
    "describe",
    "report_line",
    "check_teachers",
    "check_teacher_compatible",
    "clear_cache",
]

logger = logging.getLogger("slime_ascend.opd")

# the fields only a loaded tokenizer tells
_LOADED_FIELDS = ("tokenizer_len", *SPECIAL_ROLES, "special_tokens")
#: the compared fields, in the order they are reported
FIELDS = ("vocab_size", *_LOADED_FIELDS, "tokenizer", "chat_template", "tokenizer_revision")
# what a fast tokenizer's serialisation holds that changes how text becomes ids (decoder, padding and
# truncation do not)
_ENCODING_KEYS = ("model", "normalizer", "pre_tokenizer", "post_processor", "added_tokens")
# model files of a slow tokenizer (its vocabulary alone misses the merges / the sentencepiece model)
_SLOW_MODEL_FILES = ("tokenizer.model", "spiece.model", "merges.txt", "vocab.json", "vocab.txt",
                     "tokenizer.tiktoken", "qwen.tiktoken")

Token = tuple[int, str]


@dataclass(frozen=True)
class Fingerprint:
    """What one side (a checkpoint directory, or an engine) tells about its vocabulary and tokenizer.

    A field is None when it is unknown; :attr:`unknown` says why, by field."""

    source: str
    vocab_size: int | None = None
    tokenizer_len: int | None = None
    bos_token: Token | None = None
    eos_token: Token | None = None
    pad_token: Token | None = None
    unk_token: Token | None = None
    special_tokens: tuple[Token, ...] | None = None
    tokenizer: str | None = None
    files: str | None = None
    chat_template: str | None = None
    revision: str | None = None
    #: roles/fields read from a loaded tokenizer (False: specials and length unknown)
    tokenizer_loaded: bool = False
    unknown: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Report:
    """The comparison of one teacher with the student."""

    teacher: str
    teacher_source: str
    student_source: str
    mismatches: list[Mismatch] = field(default_factory=list)
    unchecked: dict[str, str] = field(default_factory=dict)  # field -> why

    @property
    def ok(self) -> bool:
        return not self.mismatches


def _blake(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str).encode()


def read_config_vocab_size(model_dir: str | Path) -> int | None:
    """``vocab_size`` of ``model_dir/config.json`` (or its ``text_config``); None when absent. A config that is
    no regular file, too big, malformed or nested too deeply is a ``ValueError`` naming it."""
    from ..files import read_json_object

    path = Path(model_dir) / "config.json"
    if not path.exists():
        return None
    cfg = read_json_object(path)
    vocab = cfg.get("vocab_size")
    if vocab is None and isinstance(cfg.get("text_config"), Mapping):
        vocab = cfg["text_config"].get("vocab_size")
    return int(vocab) if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def _token(tok: Any, role: str) -> Token | None:
    text = getattr(tok, role, None)
    tid = getattr(tok, role + "_id", None)
    if text is None or tid is None:
        return None
    return int(tid), str(text)


def _encoding_hash(tok: Any, model_dir: Path) -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        return "enc:" + _blake(_canonical({k: spec.get(k) for k in _ENCODING_KEYS}))
    h = hashlib.blake2b(digest_size=8)
    h.update(_canonical(sorted(tok.get_vocab().items(), key=lambda kv: kv[1])))
    for name in _SLOW_MODEL_FILES:
        p = model_dir / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes())
    return "enc:" + h.hexdigest()


def _template_hash(template: Any) -> str:
    return "tpl:none" if not template else "tpl:" + _blake(_canonical(template))


def read_chat_template(model_dir: Path) -> Any:
    """The chat template as transformers reads it: ``chat_template.jinja``, ``chat_template.json``'s
    ``chat_template``, else ``tokenizer_config.json``'s (a list of named templates becomes a dict)."""
    from ..files import read_json_object

    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        p = model_dir / name
        if p.is_file():
            template = read_json_object(p).get("chat_template")
            if template:
                if isinstance(template, list):
                    template = {t["name"]: t["template"] for t in template}
                return template
    return None


def _load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)


@functools.lru_cache(maxsize=32)
def _fingerprint_cached(path: str, stamp: tuple) -> Fingerprint:
    model_dir = Path(path)
    unknown: dict[str, str] = {}
    vocab = None
    try:
        vocab = read_config_vocab_size(model_dir)
        if vocab is None:
            unknown["vocab_size"] = f"no vocab_size in {model_dir / 'config.json'}"
    except (OSError, ValueError) as e:
        unknown["vocab_size"] = f"{model_dir / 'config.json'} unreadable ({type(e).__name__}: {e})"
    files = revision = template = None
    try:
        # uncached: this module's cache is keyed by the files' sizes and mtimes too
        tito = tito_fingerprint(str(model_dir))
        files, revision = "files:" + tito["tokenizer"], tito["revision"]
        template = _template_hash(read_chat_template(model_dir))
    except (TitoError, OSError, ValueError, KeyError, TypeError) as e:
        for name in ("tokenizer_revision", "chat_template"):
            unknown[name] = str(e)
    values: dict[str, Any] = {"chat_template": template}
    try:
        tok = _load_tokenizer(model_dir)
    except Exception as e:  # noqa: BLE001 - any failure to load is reported as "not checked", with its reason
        why = f"no tokenizer loads from {model_dir} ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
        for name in _LOADED_FIELDS:
            unknown[name] = why
        if files is None:
            unknown["tokenizer"] = why
        values["tokenizer"] = files
    else:
        values.update(
            tokenizer_len=len(tok),
            special_tokens=tuple(sorted((int(i), str(t.content)) for i, t in tok.added_tokens_decoder.items()
                                        if getattr(t, "special", False))),
            tokenizer=_encoding_hash(tok, model_dir),
            tokenizer_loaded=True,
            **{role: _token(tok, role) for role in SPECIAL_ROLES},
        )
    return Fingerprint(source=str(model_dir), vocab_size=vocab, files=files, revision=revision, unknown=unknown,
                       **values)


def _stamp(model_dir: Path) -> tuple:
    """Sizes and mtimes of the files read, so a rewritten checkpoint is read again."""
    out = []
    for p in sorted(model_dir.iterdir()) if model_dir.is_dir() else ():
        if p.is_file() and (p.suffix in (".json", ".jinja", ".txt", ".model", ".tiktoken")):
            st = p.stat()
            out.append((p.name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def fingerprint_dir(model_dir: str | Path) -> Fingerprint:
    """The fingerprint of an HF checkpoint directory (config.json and tokenizer files; weights unread).

    Cached per directory while its files are unchanged."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir} is not a directory")
    return _fingerprint_cached(str(model_dir), _stamp(model_dir))


def clear_cache() -> None:
    """Forget fingerprints and the lines already logged (tests)."""
    _fingerprint_cached.cache_clear()
    _student_side_cached.cache_clear()
    _logged.clear()


# ---- engines ----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _student_side_cached(path: str, stamp: tuple, vocab_size: int | None) -> Any:
    from .engine_probe import StudentSide, student_side

    try:
        return student_side(_load_tokenizer(Path(path)), vocab_size)
    except Exception as e:  # noqa: BLE001 - the probe's tokenizer fields are then "not checked", with why
        why = f"no tokenizer loads from {path} ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
        return StudentSide(vocab_size=vocab_size, why=why)


def _student_side(student: Fingerprint) -> Any:
    """What the student's tokenizer makes of the engine probe's fixed set (cached like fingerprints)."""
    from .engine_probe import StudentSide

    path = Path(student.source)
    if not path.is_dir():
        return StudentSide(vocab_size=student.vocab_size, why=student.unknown.get("tokenizer", "no tokenizer"))
    return _student_side_cached(str(path), _stamp(path), student.vocab_size)


# fields the engine probe checks (the four roles' tokens are among its special tokens)
_PROBED = ("special_tokens", *SPECIAL_ROLES, "tokenizer", "chat_template")


def engine_report(spec: Any, student: Fingerprint, *, timeout_s: float = 10.0) -> Report:
    """The teacher compared through its engine at ``spec.url`` (see the module docstring); raises
    :class:`~slime_ascend.opd.engine_probe.Unreachable` when the engine does not answer in ``timeout_s``."""
    from .engine_probe import EngineAsker, check_engine, engine_info

    ask = EngineAsker(spec.url, timeout_s)
    info, errors = engine_info(ask)
    vocab = info.get("vocab_size")
    vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None
    here = f"checkpoint_dir {spec.checkpoint_dir} is not a directory here"
    for key in ("tokenizer_path", "model_path"):
        path = info.get(key)
        if isinstance(path, str) and path and os.path.isdir(path):
            fp = replace(fingerprint_dir(path), source=f"{spec.url} ({key} {path})")
            fp = _with_vocab(fp, vocab) if fp.vocab_size is None and vocab is not None else fp
            return _compare_spec(spec, student, fp)
    path = info.get("tokenizer_path") or info.get("model_path")
    why = (f"{here} and the engine's tokenizer path {path!r} is not one either" if path
           else f"{here} and the engine reports no model or tokenizer path")
    unknown = {name: why for name in FIELDS}
    if vocab is None:
        unknown["vocab_size"] = f"{here} and the engine does not report vocab_size" + (
            f" ({'; '.join(errors)})" if errors else "")
    fp = Fingerprint(source=spec.url, vocab_size=vocab, unknown=unknown)
    report = _compare_spec(spec, student, fp)
    mismatches, unchecked = check_engine(spec.name, ask, _student_side(student), reported_vocab_size=vocab)
    for name in (*_PROBED, "vocab_size"):
        if name != "vocab_size" or vocab is None:
            report.unchecked.pop(name, None)
    report.unchecked.update(unchecked)
    report.mismatches += mismatches
    return report


def _with_vocab(fp: Fingerprint, vocab: int) -> Fingerprint:
    """``fp`` with a ``vocab_size`` known from elsewhere (no longer listed as unknown)."""
    return replace(fp, vocab_size=vocab, unknown={k: v for k, v in fp.unknown.items() if k != "vocab_size"})


# ---- comparison -------------------------------------------------------------------------------------
def compare(teacher: str, student: Fingerprint, teacher_fp: Fingerprint, *,
            declared_vocab_size: int | None = None, declared_revision: str | None = None) -> Report:
    """Compare a teacher's fingerprint with the student's under the module's rules.

    ``declared_vocab_size`` (the teacher entry's ``vocab_size``) replaces the teacher's read one;
    ``declared_revision`` (its ``tokenizer_revision``) is compared with the student's tito revision."""
    report = Report(teacher, teacher_fp.source, student.source)
    t_vocab = declared_vocab_size if declared_vocab_size is not None else teacher_fp.vocab_size
    for name in FIELDS:
        if name == "tokenizer_revision":
            if declared_revision is None:
                continue
            s_val, t_val = student.revision, declared_revision
        elif name == "vocab_size":
            s_val, t_val = student.vocab_size, t_vocab
        elif name == "tokenizer":
            s_val, t_val = student.tokenizer, teacher_fp.tokenizer
            # one side not loadable: compare both by their tokenizer files
            if (s_val and t_val) and s_val.split(":")[0] != t_val.split(":")[0] and student.files and teacher_fp.files:
                s_val, t_val = student.files, teacher_fp.files
        else:
            s_val, t_val = getattr(student, name), getattr(teacher_fp, name)
        if name in _LOADED_FIELDS:  # known when the tokenizer loaded; None is a value here: that token is unset
            s_unknown, t_unknown = not student.tokenizer_loaded, not teacher_fp.tokenizer_loaded
            default = "tokenizer is not loaded"
        else:
            s_unknown, t_unknown, default = s_val is None, t_val is None, name + " is unknown"
        if s_unknown or t_unknown:
            who, side = ("student", student) if s_unknown else ("teacher", teacher_fp)
            report.unchecked[name] = f"{who}: {side.unknown.get(name, default)}"
            continue
        if s_val != t_val:
            report.mismatches.append(Mismatch(teacher, name, s_val, t_val))
    return report


def _compare_spec(spec: Any, student: Fingerprint, teacher_fp: Fingerprint) -> Report:
    return compare(spec.name, student, teacher_fp, declared_vocab_size=getattr(spec, "vocab_size", None),
                   declared_revision=getattr(spec, "tokenizer_revision", None))


def _fmt(name: str, value: Any, other: Any = None) -> str:
    if value is None:
        return "unset"
    if name in SPECIAL_ROLES:
        return f"{value[0]} {value[1]!r}"
    if name == "special_tokens":
        # only the part that differs: this side's special tokens the other side lacks
        extra = sorted(set(value) - set(other or ()))
        shown = ", ".join(f"{i} {t!r}" for i, t in extra[:4]) + (f", ... ({len(extra)} in all)" if len(extra) > 4 else "")
        return "{" + shown + "}" if extra else "{}"
    return str(value)


def describe(m: Mismatch) -> str:
    """``vocab_size 151936 differs from the student's 151552``."""
    if m.detail:
        return f"{m.field}: {m.detail}"
    if m.field == "special_tokens":
        return (f"special_tokens differ: the teacher has {_fmt(m.field, m.teacher_value, m.student)} that the "
                f"student has not, the student {_fmt(m.field, m.student, m.teacher_value)}")
    return f"{m.field} {_fmt(m.field, m.teacher_value)} differs from the student's {_fmt(m.field, m.student)}"


def report_line(report: Report, student_flag: str = "--hf-checkpoint") -> str:
    """``opd teacher 'code': vocab_size 151936 differs from the student's 151552 (--hf-checkpoint)``, with
    every mismatch of the teacher and where the teacher's values were read."""
    parts = ", ".join(describe(m) for m in report.mismatches)
    return f"opd teacher {report.teacher!r}: {parts} ({student_flag}; teacher read from {report.teacher_source})"


def fix_hint(names: Sequence[str]) -> str:
    return ("Fix: give each teacher a checkpoint trained from the student's tokenizer (same vocab_size, special "
            "tokens, tokenizer and chat template); a teacher whose tokenizer is deliberately different but aligned "
            f"(e.g. a padded embedding table) can opt out with compat_check: warn (or off) in its "
            f"ascend_opd_teachers entry ({', '.join(repr(n) for n in names)}), or ascend_opd_compat_check: warn "
            "for every teacher")


# ---- teachers ---------------------------------------------------------------------------------------
_logged: set[str] = set()


def _log_once(log: logging.Logger, line: str) -> None:
    if line not in _logged:
        _logged.add(line)
        log.warning("%s", line)


def teacher_mode(spec: Any, default: str) -> str:
    """The teacher's own ``compat_check`` when set, else ``default``."""
    return getattr(spec, "compat_check", None) or default


def teacher_report(spec: Any, student: Fingerprint, *, probe: bool = True, timeout_s: float = 10.0) -> Report:
    """The teacher compared with the student: from its ``checkpoint_dir`` when it is a directory here, else
    at its engine (``url``, when ``probe``; :func:`engine_report`); otherwise every field is unknown, with why."""
    ckpt = Path(spec.checkpoint_dir)
    if ckpt.is_dir():
        return _compare_spec(spec, student, fingerprint_dir(ckpt))
    if spec.url and probe:
        return engine_report(spec, student, timeout_s=timeout_s)
    why = f"checkpoint_dir {ckpt} is not a directory here" + ("" if spec.url else " and the teacher has no url")
    return _compare_spec(spec, student, Fingerprint(source=f"checkpoint_dir {ckpt}",
                                                    unknown={name: why for name in FIELDS}))


def unreachable_hint(names: Sequence[str]) -> str:
    return (f"start the engine of {', '.join(repr(n) for n in names)} before the job (or correct its url), make "
            "its checkpoint_dir readable here, or skip the check with compat_check: off in its ascend_opd_teachers entry")


def unchecked_line(report: Report) -> str:
    by_reason: dict[str, list[str]] = {}
    for name, why in report.unchecked.items():
        by_reason.setdefault(why, []).append(name)
    return f"opd teacher {report.teacher!r}: not checked against the student: " + "; ".join(
        f"{', '.join(names)} ({why})" for why, names in by_reason.items())


def check_teachers(teachers: Sequence[Any], student_dir: str | Path | None, *, mode: str = "strict",
                   student_vocab_size: int | None = None, student_flag: str = "--hf-checkpoint",
                   probe: bool = True, timeout_s: float = 10.0, log: logging.Logger = logger) -> list[Report]:
    """Compare every teacher (a :class:`~slime_ascend.opd.teachers.TeacherSpec`) with the student.

    Each teacher's mode is its ``compat_check``, else ``mode``. ``strict`` teachers with a mismatch, or
    asked at an engine that does not answer within ``timeout_s`` (all of that teacher's requests together),
    raise :class:`~slime_ascend.opd.teachers.TeacherMismatchError` (one line: each such teacher's mismatches
    or its address, and the Fix); ``warn`` teachers' are logged; ``off`` teachers are skipped (nothing is
    read or asked). Fields that could not be compared are logged once per process, naming the teacher and
    why. ``student_vocab_size`` stands in when the student's config.json has none. Returns the reports of
    the teachers that were compared."""
    from .engine_probe import Unreachable

    if mode not in MODES:
        raise ValueError(f"compat_check mode must be one of {MODES}, got {mode!r}")
    active = [t for t in teachers if teacher_mode(t, mode) != "off"]
    if not active:
        return []
    student_ok = student_dir is not None and Path(student_dir).is_dir()
    if student_ok:
        student = fingerprint_dir(student_dir)
    else:
        why = (f"the student's {student_flag} {student_dir} is not a directory here" if student_dir
               else f"the student's {student_flag} is not set")
        student = Fingerprint(source=str(student_dir), unknown={name: why for name in FIELDS})
    if student.vocab_size is None and student_vocab_size is not None:
        student = _with_vocab(student, int(student_vocab_size))
    if not student_ok and student.vocab_size is None:
        _log_once(log, f"opd teacher compatibility not checked: {student.unknown['vocab_size']}")
        return []
    reports, refused, silent = [], [], []
    for spec in active:
        strict = teacher_mode(spec, mode) == "strict"
        try:
            report = teacher_report(spec, student, probe=probe, timeout_s=timeout_s)
        except Unreachable as e:
            line = f"opd teacher {spec.name!r}: {e}"
            if strict:
                silent.append((spec.name, line))
            else:
                _log_once(log, line + " (compat_check: warn: starting unchecked)")
            continue
        reports.append(report)
        if report.unchecked:
            _log_once(log, unchecked_line(report))
        if report.mismatches:
            if strict:
                refused.append(report)
            else:
                _log_once(log, report_line(report, student_flag) + " (compat_check: warn: starting anyway)")
    if refused or silent:
        lines = [report_line(r, student_flag) for r in refused] + [line for _, line in silent]
        hints = ([fix_hint([r.teacher for r in refused])] if refused else []) + (
            [("Fix: " if not refused else "and ") + unreachable_hint([n for n, _ in silent])] if silent else [])
        raise TeacherMismatchError("; ".join(lines) + ". " + "; ".join(hints))
    return reports


def check_teacher_compatible(
    teacher: TeacherSpec,
    *,
    student_vocab_size: int | None = None,
    student_tokenizer_revision: str | None = None,
    student_dir: str | Path | None = None,
    mode: str = "strict",
) -> None:
    """Raise :class:`TeacherMismatchError` when the teacher cannot score the student's tokens.

    The rules and fields are this module's (vocab size, tokenizer length, special
    tokens, tokenizer, chat template; the teacher's declared ``vocab_size`` / ``tokenizer_revision``),
    read from ``student_dir`` and the teacher's ``checkpoint_dir`` (no engine is asked here);
    ``student_vocab_size`` stands in when the student's config.json has none, and
    ``student_tokenizer_revision`` is compared with the teacher's declared revision when there is no
    ``student_dir``. ``mode`` (strict | warn | off) applies unless the teacher has its own
    ``compat_check``; warn logs instead of raising. A missing checkpoint directory is not a mismatch.
    """
    effective = teacher_mode(teacher, mode)
    if effective == "off":
        return
    if (
        student_dir is None
        and teacher.tokenizer_revision is not None
        and student_tokenizer_revision is not None
        and teacher.tokenizer_revision != student_tokenizer_revision
    ):
        line = (f"opd teacher {teacher.name!r}: tokenizer_revision {teacher.tokenizer_revision} differs from the "
                f"student's {student_tokenizer_revision}")
        if effective == "strict":
            raise TeacherMismatchError(line + ". " + fix_hint([teacher.name]))
        logger.warning("%s (compat_check: warn: starting anyway)", line)
    check_teachers([teacher], student_dir, mode=mode, student_vocab_size=student_vocab_size, probe=False)

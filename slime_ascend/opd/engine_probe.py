"""A remote teacher checked at its engine: does it tokenize, template and score as the student does?

A teacher served at a URL whose checkpoint the driver cannot read is compared on what its engine
answers. Real SGLang (0.5.15) reports neither ``vocab_size`` nor its tokenizer's files over HTTP
(``/model_info``, ``/server_info``), so the engine is asked to *do* things, and the answers are compared
with what the student's tokenizer does with the same fixed probe set:

* ``/tokenize`` (``/v1/tokenize`` when that is the name served; sglang/srt/entrypoints/http_server.py:1648-1663,
  openai/protocol.py:1225-1267, openai/serving_tokenize.py:39-115), one list prompt without added special
  tokens: the text of every student special token and of its bos/eos/pad/unk tokens (the lowest and
  highest ``MAX_SPECIALS / 2`` ids when there are more) -> field ``special_tokens``; fixed texts (ASCII, white space, code, accents, CJK, emoji,
  right-to-left scripts, ...) -> field ``tokenizer``. Each must give the student's ids.
* ``/tokenize`` with ``messages`` (a fixed conversation ending in a user turn): the engine applies its chat
  template with ``add_generation_prompt=True`` and encodes the result without added special tokens
  (openai/serving_chat.py:855-875); the student's ``apply_chat_template`` the same way -> field
  ``chat_template``. Skipped when the student has no chat template.
* ``/generate`` scoring the first ``SCORED_IDS`` ids of the student's probe, as OPD asks a teacher
  (``max_new_tokens`` 0, ``return_logprob``, ``logprob_start_len`` 0): one ``input_token_logprobs`` entry
  per id, the same ids, finite log-probs after the first -> field ``scoring``.
* The vocabulary bound (the largest id the engine can score or return): the engine's ``vocab_size`` when
  ``/server_info`` reports one (the torch engine does; :mod:`.compat` compares it). Otherwise through
  ``token_ids_logprob``, which SGLang checks against the model's ``vocab_size`` before it runs anything
  (managers/tokenizer_manager.py:1074-1092: HTTP 400 outside ``[0, vocab_size)``): the scoring request asks
  for id ``V - 1`` (``V``: the student's vocab_size), so an engine with a smaller vocabulary refuses it
  before it embeds a single student id; a second request asks for id ``V``, which an engine of the
  student's size refuses and one with a larger vocabulary scores -> field ``vocab_size``.

An engine that gives no answer at all (refused, reset, timed out, or not done within the check's
deadline: one deadline for all of a teacher's requests, however slowly the bytes come) raises
:class:`Unreachable`. An endpoint the engine does not serve (404/405/501) leaves its fields *not checked*,
with why; any other refusal is a mismatch, quoting the engine's answer.

Pure: no slime, no Ray (the student's tokenizer is passed in).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..json_client import JSONRequestError, request_json
from .mismatch import SPECIAL_ROLES, Mismatch

__all__ = ["PROBE_TEXTS", "PROBE_CONVERSATION", "EngineAsker", "StudentSide", "Unreachable", "check_engine",
           "engine_info", "student_side"]

#: fixed texts: ASCII, white space and code, accents, CJK, emoji (with joiners), symbols, right-to-left scripts
PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog. 0123456789 3.14159 -42",
    "  leading spaces,\ttabs\nand\r\nnew lines   trailing  ",
    "def f(x):\n    return {'a': x ** 2, \"b\": [1, 2]}  # comment",
    "naïve café, Ærøskøbing, Straße, Ελληνικά, русский текст, Türkçe ığ",
    "中文分词测试，日本語のテキスト、한국어 문장입니다。",
    "emoji 🙂🚀👩‍👩‍👧 and symbols ∑∫√≠ ™ © ₿ ½ ‰",
    "combining e\u0301 (e + U+0301), العربية, עברית, ภาษาไทย, हिन्दी",
    "\u00a0no-break space, zero\u200bwidth, \U0001f9ec\U0001d54f, tab\u3000ideographic space",
)
#: a fixed conversation, ending in a user turn (SGLang turns a final assistant turn into a user one)
PROBE_CONVERSATION = (
    {"role": "system", "content": "You are a careful assistant. Antworte kurz."},
    {"role": "user", "content": "What is 2 + 2? 请用中文回答。"},
    {"role": "assistant", "content": "2 + 2 = 4。答案是四 🙂"},
    {"role": "user", "content": "And 3 × 3?"},
)
MAX_SPECIALS = 512
SCORED_IDS = 24
_SHOWN_IDS = 8

Ids = tuple[int, ...]


class Unreachable(Exception):
    """The teacher's engine gave no (complete) answer: the message names the address and why."""


@dataclass(frozen=True)
class StudentSide:
    """What the student's tokenizer makes of the probe set (see the module docstring)."""

    vocab_size: int | None
    specials: tuple[tuple[str, Ids], ...] = ()
    texts: tuple[tuple[str, Ids], ...] = ()
    chat: Ids | None = None  # None: the student has no chat template
    #: why the tokenizer-based fields are unknown (None: the tokenizer loaded)
    why: str | None = None

    @property
    def scored(self) -> Ids:
        """The prefix the engine is asked to score: the conversation's ids, else the texts'."""
        ids = self.chat or tuple(i for _, t in self.texts for i in t)
        return ids[:SCORED_IDS] or (0,)


def student_side(tokenizer: Any, vocab_size: int | None) -> StudentSide:
    """The probe set as the student's (transformers) ``tokenizer`` encodes it."""
    roles = ((getattr(tokenizer, r + "_id", None), getattr(tokenizer, r, None)) for r in SPECIAL_ROLES)
    specials = sorted({(int(i), str(t.content)) for i, t in tokenizer.added_tokens_decoder.items()
                       if getattr(t, "special", False)} | {(int(i), str(t)) for i, t in roles if None not in (i, t)})
    if len(specials) > MAX_SPECIALS:
        specials = specials[:MAX_SPECIALS // 2] + specials[-MAX_SPECIALS // 2:]

    def encode(text: str) -> Ids:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    chat = None
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([dict(m) for m in PROBE_CONVERSATION], tokenize=False,
                                                 add_generation_prompt=True)
        chat = encode(rendered)
    return StudentSide(vocab_size=vocab_size, specials=tuple((t, encode(t)) for _, t in specials),
                       texts=tuple((t, encode(t)) for t in PROBE_TEXTS), chat=chat)


class EngineAsker:
    """One engine's endpoints, every request under one deadline for the whole check (``deadline_s``)."""

    def __init__(self, url: str, deadline_s: float) -> None:
        self.base, self.deadline_s = url.rstrip("/"), deadline_s
        self._end = time.monotonic() + deadline_s

    def __call__(self, path: str, payload: Any = None) -> Any:
        """The decoded answer; JSONRequestError for an HTTP error answer; :class:`Unreachable` for none."""
        left = self._end - time.monotonic()
        try:
            if left <= 0:
                raise JSONRequestError(self.base + path, 0, "not asked")
            return request_json(self.base + path, payload, timeout_s=left, deadline_s=left)
        except JSONRequestError as e:
            if e.status is not None:
                raise
            if time.monotonic() >= self._end - 0.05:
                why = f"no complete answer within the {self.deadline_s:g} s the check allows"
            else:
                why = str(e).split("attempt(s): ", 1)[-1]
            raise Unreachable(f"{self.base} did not answer {path} ({why})") from None


def engine_info(ask: Callable[[str, Any], Any]) -> tuple[dict[str, Any], list[str]]:
    """``/model_info`` (``/get_model_info`` where only that is served) and ``/server_info`` (likewise):
    ``model_path``, ``tokenizer_path`` and, where the engine reports it, ``vocab_size``; with the HTTP
    errors of endpoints that answered with one. :class:`Unreachable` when the engine does not answer."""
    info: dict[str, Any] = {}
    errors: list[str] = []
    for group in (("/model_info", "/get_model_info"), ("/server_info", "/get_server_info")):
        failed = []
        for path in group:
            try:
                answer = ask(path, None)
            except JSONRequestError as e:
                failed.append(f"{path}: HTTP {e.status}")
                continue
            if isinstance(answer, Mapping):
                for key in ("model_path", "tokenizer_path", "vocab_size"):
                    if answer.get(key) is not None and key not in info:
                        info[key] = answer[key]
            failed = []
            break
        errors += failed
    return info, errors


def _answer(e: JSONRequestError) -> str:
    return str(e).split("attempt(s): ", 1)[-1][:300]


def _show(ids: Sequence[int], start: int) -> str:
    part = list(ids[start:start + _SHOWN_IDS])
    return ("[..., " if start else "[") + ", ".join(map(str, part)) + (", ...]" if len(ids) > start + _SHOWN_IDS else "]")


def _differs(what: str, student: Ids, teacher: Any) -> str:
    """``'naïve café' gives [..., 412, 99] at the teacher, [..., 300] at the student (from position 3 on)``."""
    teacher = tuple(teacher)
    at = next((i for i, (a, b) in enumerate(zip(student, teacher, strict=False)) if a != b), min(len(student), len(teacher)))
    return (f"{what} gives {_show(teacher, at)} at the teacher, {_show(student, at)} at the student"
            + (f" (from position {at} on)" if at else ""))


def _quote(text: str) -> str:
    return repr(text if len(text) <= 32 else text[:31] + "…")


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


class _Probe:
    def __init__(self, teacher: str, ask: Callable[[str, Any], Any], student: StudentSide) -> None:
        self.teacher, self.ask, self.student = teacher, ask, student
        self.mismatches: list[Mismatch] = []
        self.unchecked: dict[str, str] = {}
        self._tokenize_path: str | None = "/tokenize"

    def mismatch(self, name: str, detail: str) -> None:
        self.mismatches.append(Mismatch(self.teacher, name, None, None, detail))

    def tokenize(self, payload: dict[str, Any], fields: Sequence[str]) -> Any:
        """The engine's ``tokens``, or None (its fields then recorded as unchecked / mismatched)."""
        for path in dict.fromkeys((self._tokenize_path, "/v1/tokenize") if self._tokenize_path else ()):
            try:
                answer = self.ask(path, payload)
            except JSONRequestError as e:
                if e.status in (404, 405, 501):  # not served under this name
                    continue
                for name in fields:
                    self.mismatch(name, f"the teacher refuses {path} ({_answer(e)})")
                return None
            self._tokenize_path = path
            tokens = answer.get("tokens") if isinstance(answer, Mapping) else None
            if tokens is None:
                for name in fields:
                    self.mismatch(name, f"the teacher's {path} answer has no 'tokens' ({str(answer)[:120]})")
            return tokens
        for name in fields:
            self.unchecked[name] = "the teacher's engine serves neither /tokenize nor /v1/tokenize (HTTP 404)"
        self._tokenize_path = None
        return None

    def texts(self) -> None:
        s = self.student
        probes = [("special_tokens", t, ids) for t, ids in s.specials] + [("tokenizer", t, ids) for t, ids in s.texts]
        tokens = self.tokenize({"prompt": [t for _, t, _ in probes], "add_special_tokens": False},
                               ("special_tokens", "tokenizer"))
        if tokens is None:
            return
        if not (isinstance(tokens, list) and len(tokens) == len(probes) and all(_is_ids(t) for t in tokens)):
            self.mismatch("tokenizer", f"the teacher's /tokenize answer is not one id list per prompt "
                                       f"({len(probes)} prompts; got {str(tokens)[:120]})")
            return
        differ: dict[str, list[str]] = {}
        for (name, text, ids), got in zip(probes, tokens, strict=True):
            if tuple(got) != ids:
                differ.setdefault(name, []).append(_differs(_quote(text), ids, got))
        for name, found in differ.items():
            self.mismatch(name, found[0] + (f" ({len(found) - 1} more of the probe texts differ)" if len(found) > 1 else ""))

    def chat(self) -> None:
        if self.student.chat is None:
            self.unchecked["chat_template"] = "student: the student's tokenizer has no chat template"
            return
        tokens = self.tokenize({"messages": [dict(m) for m in PROBE_CONVERSATION]}, ("chat_template",))
        if tokens is None:
            return
        if not _is_ids(tokens):
            self.mismatch("chat_template", f"the teacher's /tokenize answer for messages is not an id list "
                                           f"({str(tokens)[:120]})")
        elif tuple(tokens) != self.student.chat:
            self.mismatch("chat_template", _differs("the probe conversation with the chat template applied",
                                                    self.student.chat, tokens))

    def score(self, extra: dict[str, Any]) -> Any:
        """POST the scoring request (with ``extra``); the answer, or the JSONRequestError it raised."""
        payload = {"input_ids": list(self.student.scored), "return_logprob": True, "logprob_start_len": 0,
                   "sampling_params": {"temperature": 1.0, "max_new_tokens": 0, "skip_special_tokens": False}, **extra}
        try:
            return self.ask("/generate", payload)
        except JSONRequestError as e:
            return e

    def check_scored(self, answer: Any) -> None:
        ids = self.student.scored
        meta = answer.get("meta_info") if isinstance(answer, Mapping) else None
        entries = meta.get("input_token_logprobs") if isinstance(meta, Mapping) else None
        if not isinstance(entries, list) or not all(isinstance(e, list | tuple) and len(e) >= 2 for e in entries):
            self.mismatch("scoring", f"the teacher's /generate answer has no meta_info.input_token_logprobs "
                                     f"of [logprob, id, ...] entries ({str(answer)[:120]})")
            return
        got = tuple(e[1] for e in entries)
        if got != ids:
            self.mismatch("scoring", _differs(f"scoring the {len(ids)} probe ids", ids, got))
            return
        bad = [i for i, e in enumerate(entries[1:], 1) if not isinstance(e[0], int | float) or not math.isfinite(e[0])]
        if bad:
            self.mismatch("scoring", f"the teacher's log-prob of probe id {bad[0]} is {entries[bad[0]][0]!r}")

    def vocabulary(self, reported: int | None) -> None:
        vocab = self.student.vocab_size
        if reported is not None:  # compared by compat; score only ids the engine says it has
            if max(self.student.scored) < reported:
                answer = self.score({})
                if isinstance(answer, JSONRequestError):
                    self.mismatch("scoring", f"the teacher refuses to score the probe ids ({_answer(answer)})")
                else:
                    self.check_scored(answer)
            return
        if vocab is None:
            self.unchecked["vocab_size"] = "the student's vocab_size is unknown and the engine does not report one"
            return
        answer = self.score({"token_ids_logprob": [vocab - 1]})
        if isinstance(answer, JSONRequestError) and answer.status >= 500:
            self.mismatch("scoring", f"the teacher fails to score the probe ids ({_answer(answer)})")
            return
        if isinstance(answer, JSONRequestError):
            self.mismatch("vocab_size", f"the teacher refuses token id {vocab - 1}, the student's largest "
                                        f"(vocab_size {vocab}), in token_ids_logprob ({_answer(answer)})")
            return
        self.check_scored(answer)
        beyond = self.score({"token_ids_logprob": [vocab]})
        if not isinstance(beyond, JSONRequestError):
            self.mismatch("vocab_size", f"the teacher scores token id {vocab}, past the student's vocab_size {vocab}: "
                                        "its vocabulary is larger (its log-probs normalise over rows the student "
                                        "never produces)")
        elif beyond.status >= 500:
            self.unchecked["vocab_size"] = f"the teacher answered token id {vocab} with {_answer(beyond)}"


def check_engine(teacher: str, ask: Callable[[str, Any], Any], student: StudentSide, *,
                 reported_vocab_size: int | None = None) -> tuple[list[Mismatch], dict[str, str]]:
    """Probe the engine behind ``ask`` (an :class:`EngineAsker`) against ``student``: ``(mismatches,
    unchecked)``, by field. :class:`Unreachable` when the engine stops answering."""
    probe = _Probe(teacher, ask, student)
    if student.why is None:
        probe.texts()
        probe.chat()
    else:
        for name in ("special_tokens", "tokenizer", "chat_template"):
            probe.unchecked[name] = f"student: {student.why}"
    probe.vocabulary(reported_vocab_size)
    return probe.mismatches, probe.unchecked

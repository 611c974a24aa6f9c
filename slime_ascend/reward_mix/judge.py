"""``judge``: a generative model's verdict as a ``reward-mix`` term.

The judge is asked over SGLang's ``POST {url}/generate`` (an SGLang server, slime's router, or
``slime-ascend serve-torch``) with ``template`` filled from the sample, greedy, at most ``max_new_tokens``;
the first verdict word found in its answer (whole words, case-insensitive, earliest in the text) gives the
value from ``verdicts``::

    ascend_reward_components:
      - {name: judge, path: slime_ascend.reward_mix.judge.verdict, weight: 0.5,
         kwargs: {url: "http://judge-host:30000",
                  template: "Question: {prompt}\nAnswer: {response}\nIs the answer correct? Reply yes or no.\n",
                  verdicts: {"yes": 1.0, "no": 0.0}}}

Each call is retried ``retries`` times on a connection error, a timeout or a 5xx; the term's deadline is
reward-mix's ``ascend_reward_term_timeout_s``. An answer with no verdict word, or a call that still fails,
raises: reward-mix fails the sample (never a low score).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from ..json_client import arequest_json
from .render import check_request, check_template, render

DEFAULT_VERDICTS = {"yes": 1.0, "no": 0.0}


class JudgeError(RuntimeError):
    """The judge gave no verdict for a sample (the sample fails)."""


def parse_verdict(text: str, verdicts: Mapping[str, float]) -> float | None:
    """The value of the verdict word found earliest in ``text`` (whole word, case-insensitive), else None."""
    best: tuple[int, float] | None = None
    for word, value in verdicts.items():
        found = re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text, flags=re.IGNORECASE)
        if found and (best is None or found.start() < best[0]):
            best = (found.start(), float(value))
    return None if best is None else best[1]


async def verdict(args: Any, sample: Any, url: str, template: str, verdicts: Mapping[str, float] | None = None,
                  max_new_tokens: int = 16, retries: int = 2, timeout_s: float = 30.0) -> float:
    verdicts = DEFAULT_VERDICTS if verdicts is None else verdicts
    payload = {"text": render(template, sample),
               "sampling_params": {"temperature": 0.0, "max_new_tokens": int(max_new_tokens)}}
    answer = await arequest_json(url.rstrip("/") + "/generate", payload, timeout_s=timeout_s, retries=retries)
    text = answer.get("text") if isinstance(answer, dict) else None
    if not isinstance(text, str):
        raise JudgeError(f"{url}/generate answered no text: {str(answer)[:200]}")
    value = parse_verdict(text, verdicts)
    if value is None:
        raise JudgeError(f"no verdict in the judge's answer {text[:80]!r} (expected one of {sorted(verdicts)})")
    return value


def check_kwargs(url: Any = None, template: Any = None, verdicts: Any = None, max_new_tokens: int = 16,
                 retries: int = 2, timeout_s: float = 30.0) -> None:
    """ValueError naming the first unusable kwarg (reward-mix calls it when the job starts)."""
    check_request(url, retries, timeout_s, "judge server")
    check_template(template, "kwargs.template")
    if verdicts is not None:
        if not isinstance(verdicts, Mapping) or not verdicts:
            raise ValueError(f"kwargs.verdicts must map verdict words to values, e.g. {{yes: 1.0, no: 0.0}}, got "
                             f"{verdicts!r}")
        for word, value in verdicts.items():
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"kwargs.verdicts has a key that is not a word: {word!r}")
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"kwargs.verdicts[{word!r}] must be a finite number, got {value!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"kwargs.max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")


verdict.check_kwargs = check_kwargs  # type: ignore[attr-defined]  # reward-mix's start-up check of the kwargs

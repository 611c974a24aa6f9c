"""What a model-based term (``orm``, ``judge``) sends for one sample: a template over its prompt, response and label,
and the checks of the request kwargs both terms take (the server's URL, retries, the per-socket timeout).

A template is a ``str.format`` string with the fields ``{prompt}``, ``{response}`` and ``{label}`` (``{{`` and
``}}`` for literal braces), checked when the job starts (:func:`check_template`). slime's prompt is text when
``--apply-chat-template`` rendered it (what a reward model or judge reads); a prompt still a message list is
rendered as ``role: content`` lines, which a template can wrap.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from typing import Any

FIELDS = ("prompt", "response", "label")


def check_template(template: Any, where: str) -> None:
    """ValueError naming ``where`` unless ``template`` is a format string over :data:`FIELDS` only."""
    if not isinstance(template, str) or not template:
        raise ValueError(f"{where}: template must be a non-empty string, e.g. '{{prompt}}{{response}}', got "
                         f"{template!r}")
    try:
        names = [name for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ValueError(f"{where}: template {template[:60]!r} is not a format string ({exc}); write literal "
                         "braces as {{ and }}") from None
    unknown = sorted({n for n in names if n not in FIELDS})
    if unknown:
        raise ValueError(f"{where}: template names {unknown}; it may use {{prompt}}, {{response}} and {{label}} "
                         "(literal braces: {{ and }})")


def prompt_text(prompt: Any) -> str:
    """slime's ``sample.prompt`` as text: itself, or a message list as ``role: content`` lines."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
        return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in prompt)
    raise ValueError(f"sample.prompt is a {type(prompt).__name__}, not text or a message list")


def render(template: str, sample: Any) -> str:
    label = getattr(sample, "label", None)
    return template.format(prompt=prompt_text(getattr(sample, "prompt", "")),
                           response=str(getattr(sample, "response", "") or ""),
                           label="" if label is None else str(label))


def check_request(url: Any, retries: Any, timeout_s: Any, server: str) -> None:
    """ValueError naming the first unusable one of a model term's request kwargs (``server`` names it)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"kwargs.url must be the {server}'s http(s) URL, got {url!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"kwargs.retries must be an integer >= 0, got {retries!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
        raise ValueError(f"kwargs.timeout_s must be a number of seconds > 0, got {timeout_s!r}")

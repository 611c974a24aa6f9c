"""Prompt texts and turn formatting for compaction rollouts.

* The summary instruction (q_sum) and the resume template (u_resume, with ``{task}`` and ``{summary}``
  placeholders) are text files; defaults live in ``templates/`` and can be replaced by paths in
  ``ascend_compaction_summary_prompt_path`` / ``ascend_compaction_resume_template_path``.
* A turn format turns (system, task) into the first prompt and an observation into the text that
  closes the assistant turn, shows the observation as a user turn, and opens the next assistant turn.
  ``ChatTemplateTurnFormat`` derives these pieces from the tokenizer's chat template;
  ``PlainTurnFormat`` is a template-free fallback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "ChatTemplateTurnFormat",
    "PlainTurnFormat",
    "TurnFormat",
    "load_resume_template",
    "load_summary_prompt",
    "make_turn_format",
    "render_resume",
]

TEMPLATE_DIR = Path(__file__).parent / "templates"
DEFAULT_SUMMARY_PROMPT_PATH = TEMPLATE_DIR / "summary_prompt.txt"
DEFAULT_RESUME_TEMPLATE_PATH = TEMPLATE_DIR / "resume_template.txt"


def _read(path: str | Path, what: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} file {str(p)!r} does not exist")
    return p.read_text(encoding="utf-8").strip()


def load_summary_prompt(path: str | Path | None = None) -> str:
    """The summary instruction q_sum (default: ``templates/summary_prompt.txt``)."""
    return _read(path or DEFAULT_SUMMARY_PROMPT_PATH, "ascend_compaction_summary_prompt_path")


def load_resume_template(path: str | Path | None = None) -> str:
    """The resume template; must contain ``{summary}`` (``{task}`` optional)."""
    text = _read(path or DEFAULT_RESUME_TEMPLATE_PATH, "ascend_compaction_resume_template_path")
    if "{summary}" not in text:
        raise ValueError("the resume template must contain the placeholder {summary}")
    return text


def render_resume(template: str, *, task: str, summary: str) -> str:
    """Fill ``{task}``/``{summary}`` literally (other braces in the template are left alone)."""
    return template.replace("{task}", task).replace("{summary}", summary)


class TurnFormat(Protocol):
    def initial_text(self, system: str, user: str) -> str: ...

    def observation_text(self, observation: str) -> str: ...


class PlainTurnFormat:
    """Template-free turns: ``System/User/Assistant:`` labels separated by blank lines."""

    def initial_text(self, system: str, user: str) -> str:
        head = f"{system}\n\n" if system else ""
        return f"{head}User: {user}\n\nAssistant:"

    def observation_text(self, observation: str) -> str:
        return f"\n\nUser: {observation}\n\nAssistant:"


_ACTION_MARK = "\u27e6ACTION\u27e7"
_OBS_MARK = "\u27e6OBSERVATION\u27e7"


class ChatTemplateTurnFormat:
    """Turn pieces cut from the tokenizer's chat template around marker messages."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        probe = self._render(
            "s", "u", [{"role": "assistant", "content": _ACTION_MARK}, {"role": "user", "content": _OBS_MARK}]
        )
        a = probe.find(_ACTION_MARK)
        o = probe.find(_OBS_MARK)
        if a < 0 or o < a:
            raise ValueError("the tokenizer's chat template does not render assistant and user turns in order")
        self._before_obs = probe[a + len(_ACTION_MARK) : o]
        self._after_obs = probe[o + len(_OBS_MARK) :]

    def _render(self, system: str, user: str, more: list[dict[str, str]] | None = None) -> str:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return self.tokenizer.apply_chat_template(messages + (more or []), tokenize=False, add_generation_prompt=True)

    def initial_text(self, system: str, user: str) -> str:
        return self._render(system, user)

    def observation_text(self, observation: str) -> str:
        return f"{self._before_obs}{observation}{self._after_obs}"


def make_turn_format(tokenizer: Any, use_chat_template: bool = True) -> TurnFormat:
    """Chat-template turns when the tokenizer has a template and ``use_chat_template``; plain turns otherwise."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        return ChatTemplateTurnFormat(tokenizer)
    return PlainTurnFormat()

"""``orm``: an outcome reward model's score as a ``reward-mix`` term.

Declare it as a component with ``path: slime_ascend.reward_mix.orm.score`` (``kind: outcome_model``) and the
server in ``kwargs``::

    ascend_reward_components:
      - {name: orm, path: slime_ascend.reward_mix.orm.score, kind: outcome_model, weight: 0.5,
         kwargs: {url: "http://rm-host:30000"}}

Protocols (``protocol``):

* ``classify`` (default): SGLang's native reward-model endpoint, ``POST {url}/classify`` with
  ``{"text": template(sample)}``; the score is ``embedding[label_index]``. SGLang serves a reward model so
  (``--is-embedding``), and so does ``slime-ascend serve-torch`` given a ``*ForSequenceClassification``
  checkpoint (:mod:`slime_ascend.rollout.torch_engine.reward_model`).
* ``slime-rm``: slime's ``--rm-url`` protocol (``slime.rollout.rm_hub.remote_rm``), ``POST {url}`` with
  ``{"prompt", "response", "label"}``; the answer is a number or ``{"score": number}``.

Each call is retried ``retries`` times on a connection error, a timeout or a 5xx (``timeout_s`` bounds each
socket operation); the term's deadline is reward-mix's ``ascend_reward_term_timeout_s``. A call that still
fails, or an answer without a finite score, raises: reward-mix fails the sample (an environment failure,
trained on nothing), never scores it low.
"""

from __future__ import annotations

import math
from typing import Any

from ..json_client import arequest_json
from .render import check_request, check_template, render

PROTOCOLS = ("classify", "slime-rm")
DEFAULT_TEMPLATE = "{prompt}{response}"


class ORMError(RuntimeError):
    """The reward model gave no usable score for a sample (the sample fails)."""


async def score(args: Any, sample: Any, url: str, protocol: str = "classify", template: str = DEFAULT_TEMPLATE,
                label_index: int = 0, retries: int = 2, timeout_s: float = 30.0) -> float:
    if protocol == "classify":
        answer = await arequest_json(url.rstrip("/") + "/classify", {"text": render(template, sample)},
                                     timeout_s=timeout_s, retries=retries)
        embedding = answer.get("embedding") if isinstance(answer, dict) else None
        if not isinstance(embedding, list) or len(embedding) <= label_index:
            raise ORMError(f"{url}/classify answered no embedding[{label_index}]: {str(answer)[:200]}")
        value = embedding[label_index]
    else:
        label = getattr(sample, "label", None)
        answer = await arequest_json(url, {"prompt": getattr(sample, "prompt", None),
                                           "response": getattr(sample, "response", None), "label": label},
                                     timeout_s=timeout_s, retries=retries)
        value = answer.get("score", answer.get("reward")) if isinstance(answer, dict) else answer
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ORMError(f"{url} answered a score that is not a finite number: {str(value)[:100]}")
    return float(value)


def check_kwargs(url: Any = None, protocol: str = "classify", template: str = DEFAULT_TEMPLATE,
                 label_index: int = 0, retries: int = 2, timeout_s: float = 30.0) -> None:
    """ValueError naming the first unusable kwarg (reward-mix calls it when the job starts)."""
    check_request(url, retries, timeout_s, "reward model server")
    if protocol not in PROTOCOLS:
        raise ValueError(f"kwargs.protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    check_template(template, "kwargs.template")
    if isinstance(label_index, bool) or not isinstance(label_index, int) or label_index < 0:
        raise ValueError(f"kwargs.label_index must be an integer >= 0, got {label_index!r}")


score.check_kwargs = check_kwargs  # type: ignore[attr-defined]  # reward-mix's start-up check of the kwargs

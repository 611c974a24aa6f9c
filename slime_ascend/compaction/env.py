"""Environments for compaction rollouts, and a built-in multi-step key-value lookup task.

An environment is any object with
  * ``system_prompt: str``;
  * ``reset(seed: int | None = None, task: Any = None) -> str``: the first observation (the task text);
  * ``step(action: str) -> StepResult``: accepts any action text and advances.

``KeyValueLookupEnv`` needs many steps and real context: each step reveals one ``key = value`` fact
(padded with deterministic log noise), and at the end the agent must answer a question about an
*early* fact, which the recent-pair tail of a compacted context no longer holds. It advances on any
action (so a tiny random policy produces full-length episodes) and ends on ``ANSWER: <value>`` or
after ``num_facts + answer_turns`` steps.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from slime_ascend.plugins.base import resolve

__all__ = ["BUILTIN_ENVS", "Environment", "KeyValueLookupEnv", "StepResult", "make_env"]


@dataclass(frozen=True)
class StepResult:
    """Outcome of one action: the next observation, whether the episode ended, and its reward."""

    observation: str
    done: bool
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    system_prompt: str

    def reset(self, seed: int | None = None, task: Any = None) -> str: ...

    def step(self, action: str) -> StepResult: ...


_ANSWER_RE = re.compile(r"ANSWER:\s*([^\n]*)")
_KEY_WORDS = (
    "amber", "basil", "cedar", "delta", "ember", "fjord", "gala", "heron", "iris", "jade", "kiwi", "lumen",
    "maple", "nadir", "onyx", "pearl", "quill", "raven", "sage", "tidal", "umber", "vivid", "willow", "yarrow",
)
_NOISE_WORDS = (
    "scan", "node", "cache", "warm", "ok", "retry", "shard", "ping", "idle", "sync", "queue", "flush", "tick",
)


class KeyValueLookupEnv:
    """Multi-step ``look`` task: facts arrive one per step; the final question needs an early fact.

    Deterministic given the seed. Reward is 1.0 for the exact queried value, else 0.0.
    """

    system_prompt = (
        "You are an agent with one tool, `look`, which reveals the next fact from a ledger. "
        "Reply `look` to reveal a fact. When asked the question, reply with `ANSWER: <value>`."
    )

    def __init__(self, num_facts: int = 8, noise_lines: int = 4, answer_turns: int = 2, query_early: int = 2) -> None:
        if num_facts < 1:
            raise ValueError(f"num_facts must be >= 1; got {num_facts}")
        if noise_lines < 0 or answer_turns < 1 or query_early < 1:
            raise ValueError(
                f"need noise_lines >= 0, answer_turns >= 1, query_early >= 1; "
                f"got {noise_lines}, {answer_turns}, {query_early}"
            )
        self.num_facts = num_facts
        self.noise_lines = noise_lines
        self.answer_turns = answer_turns
        self.query_early = query_early
        self._facts: list[tuple[str, str]] = []
        self._noise: list[str] = []
        self._query = 0
        self._steps = 0
        self._done = True

    def reset(self, seed: int | None = None, task: Any = None) -> str:
        """Draw facts from ``seed`` (``task`` is unused) and return the task text."""
        rng = random.Random(0 if seed is None else int(seed))
        keys = rng.sample(_KEY_WORDS, k=min(self.num_facts, len(_KEY_WORDS)))
        while len(keys) < self.num_facts:
            keys.append(f"{rng.choice(_KEY_WORDS)}{len(keys)}")
        self._facts = [(key, str(rng.randint(100, 999))) for key in keys]
        self._noise = [
            " ".join(rng.choice(_NOISE_WORDS) + str(rng.randint(0, 99)) for _ in range(6))
            for _ in range(self.num_facts * self.noise_lines)
        ]
        self._query = rng.randrange(min(self.query_early, self.num_facts))
        self._steps = 0
        self._done = False
        return (
            f"A ledger holds {self.num_facts} facts. Use `look` to read them one at a time; "
            "remember them, a question about one of them comes at the end."
        )

    def verifier_cases(self) -> dict[str, list[dict[str, Any]]]:
        """The verifier gate's cases (:mod:`slime_ascend.verifiers`), for this environment's parameters: the oracle
        reads every fact and answers the queried value; the no-action run replies nothing until the episode ends;
        the unfinished runs stop after half the facts, and after all of them without answering."""
        probe = KeyValueLookupEnv(self.num_facts, self.noise_lines, self.answer_turns, self.query_early)
        probe.reset(seed=0)
        reads = ["look"] * self.num_facts
        return {
            "oracle": [{"seed": 0, "actions": [*reads, f"ANSWER: {probe.answer}"]}],
            "no_action": [{"seed": 0, "actions": [""] * (self.num_facts + self.answer_turns)}],
            "unfinished": [{"seed": 0, "actions": reads[: max(1, self.num_facts // 2)]},
                           {"seed": 0, "actions": reads}],
        }

    @property
    def query_key(self) -> str:
        return self._facts[self._query][0]

    @property
    def answer(self) -> str:
        return self._facts[self._query][1]

    def step(self, action: str) -> StepResult:
        if self._done:
            raise ValueError("KeyValueLookupEnv.step called after the episode ended; call reset() first")
        self._steps += 1
        match = _ANSWER_RE.search(action)
        if match is not None:
            given = match.group(1).strip()
            self._done = True
            correct = given == self.answer
            return StepResult("", True, 1.0 if correct else 0.0, {"answer": given, "correct": correct})
        if self._steps <= self.num_facts:
            i = self._steps - 1
            key, value = self._facts[i]
            noise = self._noise[i * self.noise_lines : (i + 1) * self.noise_lines]
            lines = [f"[look {i + 1}/{self.num_facts}] {key} = {value}", *(f"log: {n}" for n in noise)]
            if self._steps == self.num_facts:
                lines.append(f"Question: what is the value of {self.query_key}? Reply `ANSWER: <value>`.")
            return StepResult("\n".join(lines), False, None, {"fact_index": i})
        if self._steps >= self.num_facts + self.answer_turns:
            self._done = True
            return StepResult("", True, 0.0, {"answer": None, "correct": False})
        return StepResult(
            f"No more facts. Question: what is the value of {self.query_key}? Reply `ANSWER: <value>`.",
            False,
            None,
            {},
        )


BUILTIN_ENVS: dict[str, type] = {"kv_lookup": KeyValueLookupEnv}


def make_env(spec: str | None, kwargs: dict[str, Any] | None = None) -> Environment:
    """Build an environment from a built-in name (``kv_lookup``) or a dotted ``package.module.attr`` factory."""
    spec = spec or "kv_lookup"
    if spec not in BUILTIN_ENVS and "." not in spec:
        raise ValueError(
            f"ascend_compaction_env={spec!r} is neither a built-in ({sorted(BUILTIN_ENVS)}) "
            "nor a dotted 'package.module.attr' path"
        )
    env = (BUILTIN_ENVS[spec] if spec in BUILTIN_ENVS else resolve(spec))(**(kwargs or {}))
    if not isinstance(env, Environment):
        raise TypeError(f"environment factory {spec!r} returned {type(env).__name__}, which lacks reset/step/system_prompt")
    return env

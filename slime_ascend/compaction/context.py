"""Token-level CompactionRL context rules (pure: token lists in, token lists out).

State h = (s, u, z_1..z_t) with atomic action-observation pairs z_i = (a_i, o_i). When the remaining
budget C - |h| drops below T_comp (and compactions are left), the policy writes a summary S and the
context is rebuilt as  s ⊕ u_resume(S) ⊕ z_{t-k+1..t}  (paper Eq. 7-9). Pairs are never split.

A segment is one training sample: ``tokens = prompt + response``; spans record which token ranges
are which kind and whether they are trainable (policy-written: actions, summaries) or not
(prompts, observations, summary requests, the copied tail).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "CompactionConfig",
    "Pair",
    "Segment",
    "SegmentBuilder",
    "Span",
    "rebuild_context",
    "should_compact",
    "tail_pairs",
]

TRAINABLE_KINDS = frozenset({"action", "summary"})


@dataclass(frozen=True)
class CompactionConfig:
    """C (budget), T_comp (trigger_tokens), at most ``max_compactions``, keep the last ``keep_pairs`` pairs."""

    budget: int
    trigger_tokens: int = 10240
    max_compactions: int = 3
    keep_pairs: int = 2

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"context budget C must be >= 1; got {self.budget}")
        if self.trigger_tokens < 0:
            raise ValueError(f"trigger_tokens (T_comp) must be >= 0; got {self.trigger_tokens}")
        if self.max_compactions < 0:
            raise ValueError(f"max_compactions must be >= 0; got {self.max_compactions}")
        if self.keep_pairs < 0:
            raise ValueError(f"keep_pairs (k) must be >= 0; got {self.keep_pairs}")


@dataclass(frozen=True)
class Pair:
    """One atomic action-observation pair, as token ids (observation includes its turn wrapper)."""

    action: tuple[int, ...]
    observation: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", tuple(int(t) for t in self.action))
        object.__setattr__(self, "observation", tuple(int(t) for t in self.observation))

    def __len__(self) -> int:
        return len(self.action) + len(self.observation)

    @property
    def tokens(self) -> list[int]:
        return [*self.action, *self.observation]


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, end)`` of a segment, of one ``kind``; ``trainable`` ⇔ loss mask 1."""

    kind: str
    start: int
    end: int
    trainable: bool


def should_compact(
    context_len: int,
    config: CompactionConfig,
    *,
    compactions_done: int,
    new_pairs: int,
) -> bool:
    """Eq. 7: compact when ``C - |h| < T_comp``, compactions remain, and a pair arrived since the last one.

    ``new_pairs`` (pairs completed in the current segment) guards against compacting again right after
    a rebuild whose copied tail alone is already over the threshold.
    """
    if context_len < 0 or compactions_done < 0 or new_pairs < 0:
        raise ValueError(
            f"context_len, compactions_done and new_pairs must be >= 0; got {context_len}, {compactions_done}, {new_pairs}"
        )
    if compactions_done >= config.max_compactions or new_pairs < 1:
        return False
    return config.budget - context_len < config.trigger_tokens


def tail_pairs(pairs: Sequence[Pair], keep_pairs: int) -> list[Pair]:
    """The last ``keep_pairs`` whole pairs (all of them when fewer exist)."""
    if keep_pairs < 0:
        raise ValueError(f"keep_pairs must be >= 0; got {keep_pairs}")
    return list(pairs[max(0, len(pairs) - keep_pairs) :]) if keep_pairs else []


def rebuild_context(head: Sequence[int], pairs: Sequence[Pair], keep_pairs: int) -> tuple[list[int], list[Span]]:
    """Eq. 9: ``head`` (system ⊕ resume(summary), already tokenized) ⊕ the last ``keep_pairs`` pairs.

    Returns the token list and its spans; nothing in a rebuilt context is trainable.
    """
    tokens = [int(t) for t in head]
    spans = [Span("resume", 0, len(tokens), False)]
    for pair in tail_pairs(pairs, keep_pairs):
        for kind, part in (("tail_action", pair.action), ("tail_observation", pair.observation)):
            spans.append(Span(kind, len(tokens), len(tokens) + len(part), False))
            tokens.extend(part)
    return tokens, [s for s in spans if s.end > s.start]


@dataclass
class Segment:
    """A finished segment: token ids, response length, response-aligned mask and log-probs, spans."""

    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    rollout_log_probs: list[float]
    spans: list[Span] = field(default_factory=list)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length


class SegmentBuilder:
    """Accumulates one segment: a fixed prompt, then response pieces with trainability and log-probs."""

    def __init__(self, prompt: Sequence[int], prompt_spans: Sequence[Span] | None = None) -> None:
        self.tokens = [int(t) for t in prompt]
        self.prompt_length = len(self.tokens)
        self.spans = list(prompt_spans) if prompt_spans is not None else [Span("prompt", 0, self.prompt_length, False)]
        if any(s.trainable for s in self.spans):
            raise ValueError("prompt spans must not be trainable")
        self.loss_mask: list[int] = []
        self.log_probs: list[float] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, kind: str, tokens: Sequence[int], *, log_probs: Sequence[float] | None = None) -> None:
        """Append response tokens; kinds in ``TRAINABLE_KINDS`` need log-probs, others must not have them."""
        tokens = [int(t) for t in tokens]
        trainable = kind in TRAINABLE_KINDS
        if trainable:
            if log_probs is None or len(log_probs) != len(tokens):
                got = None if log_probs is None else len(log_probs)
                raise ValueError(f"{kind} tokens need one rollout log-prob each; got {got} for {len(tokens)} tokens")
            lps = [float(x) for x in log_probs]
        else:
            if log_probs is not None:
                raise ValueError(f"non-trainable {kind} tokens must not carry log-probs")
            lps = [0.0] * len(tokens)
        if not tokens:
            return
        start = len(self.tokens)
        self.tokens.extend(tokens)
        self.loss_mask.extend([1 if trainable else 0] * len(tokens))
        self.log_probs.extend(lps)
        self.spans.append(Span(kind, start, len(self.tokens), trainable))

    def build(self) -> Segment:
        return Segment(
            tokens=list(self.tokens),
            response_length=len(self.tokens) - self.prompt_length,
            loss_mask=list(self.loss_mask),
            rollout_log_probs=list(self.log_probs),
            spans=list(self.spans),
        )

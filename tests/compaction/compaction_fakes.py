"""Test doubles for compaction rollouts: an offline byte-level tokenizer and scripted fake engines."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from slime_ascend.rollout.engine_client import GenerationResult

SPECIALS = ["<|eot|>", "<|system|>", "<|user|>", "<|assistant|>"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _byte_level_core():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return core


def make_tiny_tokenizer(chat_template: str | None = None):
    """HF ``PreTrainedTokenizerFast``: byte-level BPE without merges (every byte a token) + 4 specials."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=_byte_level_core(), eos_token="<|eot|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


class BareTinyTokenizer:
    """The same tokenizer through the ``tokenizers`` library only (for processes where transformers is stubbed)."""

    chat_template = None

    def __init__(self) -> None:
        self._core = _byte_level_core()
        self._core.add_special_tokens(SPECIALS)
        self.all_special_ids = [self._core.token_to_id(t) for t in SPECIALS]
        self.eos_token_id = self.all_special_ids[0]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._core.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._core.decode(list(ids), skip_special_tokens=skip_special_tokens)


@dataclass
class EngineCall:
    input_ids: list[int]
    sampling_params: dict[str, Any]
    output_ids: list[int]
    log_probs: list[float]
    finish_reason: str


Policy = Callable[[str, int], str]


@dataclass
class FakeEngine:
    """Deterministic engine: ``policy(decoded_context, call_index) -> text``; outputs text ids + eos.

    Log-probs are distinct per call and position so misalignment is detectable. Output is cut at
    ``max_new_tokens`` (finish ``length``), else ends with eos (finish ``stop``).
    """

    tokenizer: Any
    policy: Policy
    weight_version: str | None = "v1"
    abort_at_call: int | None = None
    calls: list[EngineCall] = field(default_factory=list)

    async def generate(self, input_ids: Sequence[int], sampling_params: dict[str, Any]) -> GenerationResult:
        k = len(self.calls)
        context = self.tokenizer.decode(list(input_ids), skip_special_tokens=False)
        ids = list(self.tokenizer.encode(self.policy(context, k), add_special_tokens=False))
        ids.append(self.tokenizer.eos_token_id)
        finish = "stop"
        limit = int(sampling_params["max_new_tokens"])
        if len(ids) > limit:
            ids, finish = ids[:limit], "length"
        if self.abort_at_call == k:
            finish = "abort"
        lps = [-(k + 1) * 0.001 - j * 1e-6 for j in range(len(ids))]
        self.calls.append(EngineCall(list(input_ids), dict(sampling_params), ids, lps, finish))
        return GenerationResult(ids, lps, finish, self.weight_version, "", {})


_FACT = re.compile(r"(\w+) = (\d+)")
_QUESTION = re.compile(r"what is the value of (\w+)\?")


def last_turn(context: str) -> str:
    cut = max(context.rfind("User:"), context.rfind("<|user|>"))
    return context[cut:] if cut >= 0 else context


def memory_policy(context: str, call_index: int) -> str:
    """A 'real' policy: looks, summarises every fact seen when asked to compact, answers from context."""
    turn = last_turn(context)
    facts = dict(_FACT.findall(context))
    if "compact" in turn:
        return "Facts so far: " + "; ".join(f"{k} = {v}" for k, v in facts.items())
    q = _QUESTION.search(turn)
    if q:
        return f"ANSWER: {facts.get(q.group(1), 'unknown')}"
    return "look"


def forgetful_policy(context: str, call_index: int) -> str:
    """Like memory_policy but writes a useless summary, so early facts are lost after compaction."""
    if "compact" in last_turn(context):
        return "I was reading the ledger."
    return memory_policy(context, call_index)


def gibberish_policy(context: str, call_index: int) -> str:
    """Random-model stand-in: deterministic junk, never answers."""
    return "zq" * (3 + call_index % 5)

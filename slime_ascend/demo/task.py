"""The demo's built-in verifiable task: answer a one-digit question in two domains.

* ``copy d =`` -> ``d``; ``next d =`` -> ``(d + 1) % 10``. The reward is 1.0 when the first token of
  the answer is the right digit, else 0.0 (exact, verifiable, no model in the loop).
* Short episodes ask the question at once (one action). Long episodes first show ``fillers`` log
  observations (any action advances), then ask; with a small context budget they run through the
  compaction plugin's segmenting generate (:class:`DigitsEnv` is its environment factory).
* The domain label lives in ``sample.metadata["domain"]`` (what the opd plugin routes on).

Starting points, all seeded and trained here in seconds (``prepare_checkpoints``):

* the initial policy: the tiny random Qwen3 fine-tuned to answer *a uniformly random digit* then
  ``</s>`` (the answer format), then a short, deliberately incomplete pass on the right answers (a weak
  SFT start, about 20-30% reward), which RL then improves;
* two teachers from that same policy (same origin), each fine-tuned on the right answers of one
  domain: the ``copy`` teacher and the ``next`` teacher.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_ascend.compaction.env import StepResult

__all__ = [
    "DOMAINS",
    "DigitsEnv",
    "Episode",
    "answer_for",
    "make_episodes",
    "prepare_checkpoints",
    "prompt_text",
    "score_action",
    "task_reward",
]

DOMAINS = ("copy", "next")
_FILLER_WORDS = ("cache", "warm", "queue", "idle", "shard", "ready", "flush", "tick", "scan", "node", "sync", "ok")


def answer_for(domain: str, digit: int) -> str:
    if domain == "copy":
        return str(digit)
    if domain == "next":
        return str((digit + 1) % 10)
    raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")


def question_text(domain: str, digit: int) -> str:
    return f"{domain} {digit} ="


def prompt_text(domain: str, digit: int) -> str:
    """What the policy sees for a short episode (the compaction plugin's plain turn format)."""
    from slime_ascend.compaction.prompts import PlainTurnFormat

    return PlainTurnFormat().initial_text("", question_text(domain, digit))


def score_action(action: str, answer: str) -> float:
    return 1.0 if action.strip()[:1] == answer else 0.0


@dataclass(frozen=True)
class Episode:
    """One prompt of the demo's dataset (``fillers > 0``: a long episode)."""

    domain: str
    digit: int
    fillers: int

    def to_task(self) -> dict[str, Any]:
        return {"domain": self.domain, "digit": self.digit, "fillers": self.fillers}


def make_episodes(rng: random.Random, n: int, long_fraction: float, fillers: tuple[int, int]) -> list[Episode]:
    """``n`` episodes: domains alternate, digits drawn from ``rng``, a ``long_fraction`` of them long."""
    n_long = int(round(n * long_fraction))
    long_slots = set(rng.sample(range(n), n_long)) if n_long else set()
    return [
        Episode(DOMAINS[i % len(DOMAINS)], rng.randrange(10), rng.randint(*fillers) if i in long_slots else 0)
        for i in range(n)
    ]


class DigitsEnv:
    """Compaction environment of the task (``ascend_compaction_env: slime_ascend.demo.task.DigitsEnv``).

    ``reset(task=Episode.to_task())``; every action before the question gets a filler observation
    (no digits in it); the action after the question ends the episode with its 0/1 reward.
    """

    system_prompt = ""

    def __init__(self, filler_words: int = 8) -> None:
        self.filler_words = filler_words
        self._task: dict[str, Any] = {}
        self._left = 0
        self._rng = random.Random(0)
        self._done = True

    def reset(self, seed: int | None = None, task: Any = None) -> str:
        if not isinstance(task, dict) or not {"domain", "digit", "fillers"} <= set(task):
            raise ValueError(f"DigitsEnv needs task={{domain, digit, fillers}} in sample.metadata['task'], got {task!r}")
        self._task = dict(task)
        self._left = int(task["fillers"])
        self._rng = random.Random(0 if seed is None else int(seed))
        self._done = False
        if self._left == 0:
            return question_text(task["domain"], int(task["digit"]))
        return "read the log, then answer"

    def step(self, action: str) -> StepResult:
        if self._done:
            raise ValueError("DigitsEnv.step called after the episode ended; call reset() first")
        if self._left > 0:
            self._left -= 1
            words = " ".join(self._rng.choice(_FILLER_WORDS) for _ in range(self.filler_words))
            obs = f"log: {words}"
            if self._left == 0:
                obs += "\n" + question_text(self._task["domain"], int(self._task["digit"]))
            return StepResult(obs, False, None, {})
        self._done = True
        answer = answer_for(self._task["domain"], int(self._task["digit"]))
        reward = score_action(action, answer)
        return StepResult("", True, reward, {"answer": answer, "given": action.strip()[:1], "correct": reward == 1.0})


def _episode_reward(sample: Any) -> float:
    """The task reward of a finished sample: from the environment's final info (compaction) or the text."""
    md = sample.metadata or {}
    info = md.get("env_info") or {}
    if "correct" in info:
        return 1.0 if info["correct"] else 0.0
    task = md.get("task") or {}
    if not task:
        raise ValueError(f"sample {sample.index!r} has no metadata['task']; it did not come from the demo dataset")
    return score_action(sample.response, answer_for(task["domain"], int(task["digit"])))


def task_reward(args: Any, sample: Any, **_: Any) -> float:
    """Reward function (``ascend_opd_task_rm_path``, or slime's ``--custom-rm-path`` without opd)."""
    return _episode_reward(sample)


async def async_task_reward(args: Any, sample: Any, **kwargs: Any) -> float:
    return task_reward(args, sample, **kwargs)


# ---------------------------------------------------------------------------------------------------
# starting checkpoints
# ---------------------------------------------------------------------------------------------------
def _sft(model: Any, examples: Sequence[tuple[list[int], list[int]]], steps: int, lr: float, seed: int,
         uniform_first: Sequence[int] | None = None) -> float:
    """Full-batch supervised steps on (prompt ids, target ids) pairs; loss on the targets only.

    ``uniform_first``: the first target position is trained towards the uniform distribution over these
    token ids instead of the given token (the answer format without the answer).
    """
    import torch

    torch.manual_seed(seed)
    width = max(len(p) + len(t) for p, t in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    attn = torch.zeros(len(examples), width, dtype=torch.long)
    first = torch.zeros(len(examples), dtype=torch.long)
    for i, (p, t) in enumerate(examples):
        seq = p + t
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        labels[i, len(p) : len(seq)] = torch.tensor(t)
        first[i] = len(p) - 1  # logit position predicting the first target
    soft = None
    if uniform_first is not None:
        soft = torch.zeros(model.config.vocab_size)
        soft[list(uniform_first)] = 1.0 / len(uniform_first)
        labels[torch.arange(len(examples)), first + 1] = -100
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_value = float("nan")
    for _ in range(steps):
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits.float()
        shifted = logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), labels[:, 1:].reshape(-1))
        if soft is not None:
            lp = torch.log_softmax(logits[torch.arange(len(examples)), first], dim=-1)
            loss = loss - (lp * soft).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_value = float(loss.detach())
    model.eval()
    return loss_value


def _answer_prob(model: Any, examples: Sequence[tuple[list[int], list[int]]]) -> float:
    """Mean probability of the first target token (the answer digit) over ``examples``."""
    import torch

    with torch.no_grad():
        total = 0.0
        for p, t in examples:
            logits = model(input_ids=torch.tensor([p]), use_cache=False).logits[0, -1].float()
            total += float(torch.softmax(logits, -1)[t[0]])
    return total / len(examples)


def prepare_checkpoints(out_dir: str | Path, seed: int, *, warm_steps: int = 40, teacher_steps: int = 40,
                        start_prob: float = 0.3, teacher_prob: float = 0.95, max_rounds: int = 40,
                        sft_lr: float = 3e-3,
                        lr: float = 1e-2) -> dict[str, str]:
    """Write ``policy_init``, ``teacher_copy`` and ``teacher_next`` HF directories under ``out_dir``.

    Returns ``{"policy": dir, "copy": dir, "next": dir}``. Deterministic given ``seed``.
    """
    import copy

    import torch

    from slime_ascend.rollout.reference_model import build_byte_tokenizer, load_model, save_model

    out_dir = Path(out_dir)
    tok = build_byte_tokenizer()
    eos = int(tok.eos_token_id)

    def enc(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    digit_ids = [enc(str(d))[0] for d in range(10)]
    prompts = {(dom, d): enc(prompt_text(dom, d)) for dom in DOMAINS for d in range(10)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest and deterministic
    with torch.random.fork_rng():
        policy = load_model(None, seed=seed).float()
        # format only: every digit is a target for every prompt -> uniform over the digits
        warm = [(p, [digit_ids[0], eos]) for p in prompts.values()]
        _sft(policy, warm, warm_steps, lr, seed, uniform_first=digit_ids)
        # then a short, deliberately incomplete pass on the right answers: a weak SFT start (~20-30%)
        answers = [(p, [digit_ids[int(answer_for(dom, d))], eos]) for (dom, d), p in prompts.items()]
        for r in range(max_rounds):  # rounds of 10 steps until p(right answer) reaches the start level
            if _answer_prob(policy, answers) >= start_prob:
                break
            _sft(policy, answers, 10, sft_lr, seed + 7 + r)
        dirs = {"policy": str(save_model(policy, out_dir / "policy_init", tok))}
        for k, dom in enumerate(DOMAINS):
            teacher = copy.deepcopy(policy)
            data = [(p, [digit_ids[int(answer_for(dom, d))], eos]) for (pd, d), p in prompts.items() if pd == dom]
            for r in range(max_rounds):  # a fresh optimizer per round converges more reliably here
                if _answer_prob(teacher, data) >= teacher_prob:
                    break
                _sft(teacher, data, teacher_steps, lr, seed + 1 + k + 100 * r)
            dirs[dom] = str(save_model(teacher, out_dir / f"teacher_{dom}", tok))
    torch.set_num_threads(threads)
    return dirs

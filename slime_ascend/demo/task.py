"""The demo's built-in verifiable task: answer a one-digit question in two domains.

* ``copy d =`` -> ``d``; ``next d =`` -> ``(d + 1) % 10``. The reward is 1.0 when the first token of
  the answer is the right digit, else 0.0 (exact, verifiable, no model in the loop).
* Short episodes ask the question at once (one action). Long episodes first show ``fillers`` log
  observations (any action advances), then ask; with a small context budget they run through the
  compaction plugin's segmenting generate (:class:`DigitsEnv` is its environment factory).
* The domain label lives in ``sample.metadata["domain"]`` (what the opd plugin routes on).

Starting points, all seeded and trained here in seconds (``prepare_checkpoints``; the tiny GLM-5 of
``slime-ascend demo --model glm5`` in a few minutes):

* the initial policy: the tiny random Qwen3 (or GLM-5) fine-tuned on the right answers, then its ``lm_head``
  alone calibrated to hedge (about 30% on the right digit, the rest spread over the other digits):
  it "knows but hedges", which RL then sharpens;
* two teachers from that same policy (same origin), each fine-tuned to answer its own domain
  confidently (about 90%) while it still hedges on the other: the ``copy`` and ``next`` teachers.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_ascend.compaction.env import StepResult
from slime_ascend.verifiers import declare_cases

__all__ = [
    "DOMAINS",
    "DigitsEnv",
    "Episode",
    "Transcript",
    "answer_for",
    "checkpoint_answer_probs",
    "make_episodes",
    "prepare_checkpoints",
    "prompt_text",
    "score_action",
    "task_reward",
    "task_transcripts",
]

DOMAINS = ("copy", "next")
LONG_TASK_TEXT = "read the log, then answer"  # the first user turn of a long episode
SUMMARY_PROMPT = "Summarize:\n"  # the compaction plugin's summary instruction, as the demo configures it
RESUME_TEMPLATE = "{task}\nnotes: {summary}\n"  # ... and its resume template
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
        return LONG_TASK_TEXT

    def verifier_cases(self) -> dict[str, list[dict[str, Any]]]:
        """The verifier gate's cases (:mod:`slime_ascend.verifiers`): the right digit, at once and after fillers;
        nothing replied; a long episode left before its question."""
        short, long = {"domain": "copy", "digit": 3, "fillers": 0}, {"domain": "next", "digit": 9, "fillers": 2}
        return {
            "oracle": [{"task": short, "actions": ["3"]}, {"task": long, "actions": ["look", "look", "0"]}],
            "no_action": [{"task": short, "actions": [""]}, {"task": long, "actions": ["", "", ""]}],
            "unfinished": [{"task": long, "actions": ["look"]}, {"task": long, "actions": ["look", "look"]}],
        }

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


def _task_reward_cases() -> dict[str, list[dict[str, Any]]]:
    """The verifier gate's cases of :func:`task_reward`: a right answer (plain and from a finished compaction
    episode), an empty answer, and truncated runs (a compaction episode stopped before its question)."""
    short, long = {"domain": "next", "digit": 3, "fillers": 0}, {"domain": "copy", "digit": 7, "fillers": 2}
    return {
        "oracle": [{"response": "4", "metadata": {"task": short}},
                   {"response": "7", "metadata": {"task": long, "env_info": {"correct": True}}}],
        "no_action": [{"response": "", "metadata": {"task": short}}],
        "unfinished": [{"response": "", "status": "truncated", "metadata": {"task": short}},
                       {"response": "look look", "status": "truncated", "metadata": {"task": long, "env_info": {}}}],
    }


@declare_cases(_task_reward_cases)
def task_reward(args: Any, sample: Any, **_: Any) -> float:
    """Reward function (``ascend_opd_task_rm_path``, or slime's ``--custom-rm-path`` without opd): the task
    reward of a finished sample, from the environment's final info (compaction) or the text."""
    md = sample.metadata or {}
    info = md.get("env_info") or {}
    if "correct" in info:
        return 1.0 if info["correct"] else 0.0
    task = md.get("task") or {}
    if not task:
        raise ValueError(f"sample {sample.index!r} has no metadata['task']; it did not come from the demo dataset")
    return score_action(sample.response, answer_for(task["domain"], int(task["digit"])))


@declare_cases(_task_reward_cases)
async def async_task_reward(args: Any, sample: Any, **kwargs: Any) -> float | list[float]:
    """slime's ``--custom-rm-path`` form: one sample, or (batch mode: slime passes the segments a custom
    generate returned as one list) a list of samples -> a list of rewards."""
    if isinstance(sample, list):
        return [task_reward(args, s, **kwargs) for s in sample]
    return task_reward(args, sample, **kwargs)


# ---------------------------------------------------------------------------------------------------
# starting checkpoints
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Transcript:
    """A supervised token sequence: ``targets`` are ``(position, token)`` pairs, the logit at ``position``
    predicting ``token``; ``answer`` is the index in ``targets`` of the answer digit (or ``None``)."""

    ids: tuple[int, ...]
    targets: tuple[tuple[int, int], ...]
    answer: int | None = None
    domain: str | None = None


def task_transcripts(tok: Any) -> list[Transcript]:
    """What the starting checkpoints are fine-tuned on: every question of both domains asked at once,
    answered with its digit and ``eos``. (Long episodes are left to RL: fine-tuning on their contexts
    made the policy's attention so sharp that one RL step moved its log-probs by several nats.)"""
    out = []
    eos = int(tok.eos_token_id)
    for dom in DOMAINS:
        for d in range(10):
            ids = [int(t) for t in tok.encode(prompt_text(dom, d), add_special_tokens=False)]
            answer = int(tok.encode(answer_for(dom, d), add_special_tokens=False)[0])
            out.append(Transcript(tuple(ids + [answer, eos]), ((len(ids) - 1, answer), (len(ids), eos)), 0, dom))
    return out


def _buckets(examples: Sequence[Transcript], size: int = 20) -> list[list[int]]:
    """Example indices grouped by length (short sequences are not padded to long ones)."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].ids))
    return [order[i : i + size] for i in range(0, len(order), size)]


def padded_batch(tokens: Sequence[Any]) -> tuple[Any, Any]:
    """Right-padded ``[B, L]`` token ids and their attention mask, from 1-D token tensors (SFT here, the trainer)."""
    import torch

    width = max(len(t) for t in tokens)
    ids = torch.zeros(len(tokens), width, dtype=torch.long)
    attn = torch.zeros(len(tokens), width, dtype=torch.long)
    for i, t in enumerate(tokens):
        ids[i, : len(t)] = t
        attn[i, : len(t)] = 1
    return ids, attn


def _sft(model: Any, examples: Sequence[Transcript], steps: int, lr: float, *,
         answer_prob: float | Sequence[float] = 1.0, answer_ids: Sequence[int] = (),
         head_only: bool = False) -> float:
    """Full-batch supervised steps on transcripts (cross-entropy of every target token); the last loss.

    ``answer_prob < 1`` (one value, or one per example): an example's answer target is trained towards a
    soft label instead, this probability on the answer and the rest spread evenly over the other
    ``answer_ids`` (a calibrated answer). ``head_only``: only ``lm_head`` is trained, on features computed
    once (the rest of the model is fixed, so that is the same optimisation, just cheaper).
    """
    import torch

    probs = [float(answer_prob)] * len(examples) if isinstance(answer_prob, (int, float)) else list(answer_prob)
    if len(probs) != len(examples) or not all(0.0 < q <= 1.0 for q in probs):
        raise ValueError(f"answer_prob must be in (0, 1], one value or one per example; got {answer_prob}")
    if any(q < 1.0 for q in probs) and len(answer_ids) < 2:
        raise ValueError("answer_ids must list at least two tokens when answer_prob < 1")
    vocab = model.config.vocab_size
    buckets = []
    for idx in _buckets(examples):
        ids, attn = padded_batch([torch.tensor(examples[i].ids) for i in idx])
        rows, cols, soft = [], [], []
        for r, i in enumerate(idx):
            ex = examples[i]
            for k, (pos, token) in enumerate(ex.targets):
                label = torch.zeros(vocab)
                q = probs[i] if k == ex.answer else 1.0
                if q < 1.0:
                    label[list(answer_ids)] = (1.0 - q) / (len(answer_ids) - 1)
                label[token] = q
                rows.append(r)
                cols.append(pos)
                soft.append(label)
        buckets.append((ids, attn, torch.tensor(rows), torch.tensor(cols), torch.stack(soft)))

    def features(ids, attn, rows, cols):  # final hidden states at the target positions
        return model.model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state[rows, cols]

    model.train()
    params = [model.lm_head.weight] if head_only else list(model.parameters())
    opt = torch.optim.Adam(params, lr=lr)
    fixed = None
    if head_only:
        with torch.no_grad():
            fixed = [features(ids, attn, rows, cols) for ids, attn, rows, cols, _ in buckets]
    n = len(examples)
    loss_value = float("nan")
    for _ in range(steps):
        loss = torch.zeros(())
        for k, (ids, attn, rows, cols, soft) in enumerate(buckets):
            h = fixed[k] if fixed is not None else features(ids, attn, rows, cols)
            loss = loss - (torch.log_softmax(model.lm_head(h).float(), dim=-1) * soft).sum() / n
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_value = float(loss.detach())
    model.eval()
    return loss_value


def _answer_prob(model: Any, examples: Sequence[Transcript]) -> float:
    """Mean probability of the answer target over ``examples`` that have one."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            if ex.answer is None:
                continue
            pos, token = ex.targets[ex.answer]
            logits = model(input_ids=torch.tensor([ex.ids[: pos + 1]]), use_cache=False).logits[0, -1].float()
            total += float(torch.softmax(logits, -1)[token])
            count += 1
    return total / max(1, count)


def _sft_until(model: Any, examples: Sequence[Transcript], judged: Sequence[Transcript], level: float,
               round_steps: int, max_rounds: int, lr: float, name: str, **kwargs: Any) -> float:
    """:func:`_sft` in rounds (a fresh optimizer each) until the answer probability on ``judged`` reaches
    ``level``; returns it. Raises when ``max_rounds`` do not get there."""
    prob = _answer_prob(model, judged)
    for _ in range(max_rounds):
        if prob >= level:
            return prob
        _sft(model, examples, round_steps, lr, **kwargs)
        prob = _answer_prob(model, judged)
    if prob < level:
        raise RuntimeError(f"fine-tuning {name} reached p(answer) {prob:.3f} < {level:.3f} after {max_rounds} rounds "
                           f"of {round_steps} steps; raise max_rounds or sft_lr")
    return prob


# the fine-tuning of the tiny GLM-5 (prepare_checkpoints(glm5=True)): Adam at the Qwen3's 3e-3 oscillates there (a
# fresh optimizer each round; measured p(answer) 0.59 after 8 rounds, 0.46 after 14) and 1e-2 / 3e-2 stay under
# 0.2; at 1e-3 it reached 0.918 in 7 rounds of 50 steps, the teachers 0.902 and 0.891 on their domains, the
# calibrated policy 0.28 / 0.29 (seed 0; 231 s on the shared 2-core host, 101 s of CPU)
GLM5_SFT: dict[str, Any] = dict(sft_lr=1e-3, sft_prob=0.9, max_rounds=12)


def prepare_checkpoints(out_dir: str | Path, seed: int, *, sft_lr: float = 3e-3, sft_prob: float = 0.95,
                        start_prob: float = 0.3, teacher_prob: float = 0.9, calibrate_steps: int = 100,
                        calibrate_lr: float = 1e-2, round_steps: int = 50, max_rounds: int = 8,
                        glm5: bool = False) -> dict[str, str]:
    """Write ``policy_init``, ``teacher_copy`` and ``teacher_next`` HF directories under ``out_dir``.

    ``glm5``: the model is the tiny GLM-5 (:func:`slime_ascend.glm5.tiny.tiny_glm5_config`: MoE, MLA, DSA with
    IndexShare) instead of the tiny Qwen3, the same fine-tuning (the demo passes :data:`GLM5_SFT`).

    * ``policy_init``: the tiny random Qwen3 fine-tuned on :func:`task_transcripts` (both domains'
      answers), so its features learn the task; then its ``lm_head`` alone calibrated to an
      under-confident answer, ``start_prob`` on the right digit and the rest spread over the other
      digits: a policy that "knows but hedges", as a pretrained model often does, which RL sharpens.
      Full-batch training with no dropout: ``seed`` only sets the random initial weights.
    * ``teacher_<domain>``: the same policy (same origin) fine-tuned to ``teacher_prob`` on its own
      domain's answers (confident, not saturated) while it still hedges (``start_prob``) on the other
      domain: each teacher is the expert of one domain only.

    Fine-tuning runs in rounds of ``round_steps`` until the answer probability reaches its level
    (``sft_prob``; ``teacher_prob`` on the teacher's domain), at most ``max_rounds``; it is an error
    if it does not get there (the demo would then start from a policy that does not know the task).

    Returns ``{"policy": dir, "copy": dir, "next": dir}``. Deterministic given ``seed``.
    """
    import copy

    import torch

    from slime_ascend.rollout.torch_engine.model import build_byte_tokenizer, load_model, save_model

    out_dir = Path(out_dir)
    tok = build_byte_tokenizer()
    digit_ids = [int(tok.encode(str(d), add_special_tokens=False)[0]) for d in range(10)]
    examples = task_transcripts(tok)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest and deterministic
    try:
        with torch.random.fork_rng():
            policy = load_model(None, seed=seed, glm5=glm5).float()
            _sft_until(policy, examples, examples, sft_prob, round_steps, max_rounds, sft_lr, "policy_init")
            _sft(policy, examples, calibrate_steps, calibrate_lr, answer_prob=start_prob, answer_ids=digit_ids,
                 head_only=True)
            dirs = {"policy": str(save_model(policy, out_dir / "policy_init", tok))}
            for dom in DOMAINS:
                teacher = copy.deepcopy(policy)  # an expert of its domain; it still hedges on the other one
                target = [teacher_prob if ex.domain == dom else start_prob for ex in examples]
                own = [ex for ex in examples if ex.domain == dom]
                _sft_until(teacher, examples, own, teacher_prob - 0.02, round_steps, max_rounds, sft_lr,
                           f"teacher_{dom}", answer_prob=target, answer_ids=digit_ids)
                dirs[dom] = str(save_model(teacher, out_dir / f"teacher_{dom}", tok))
    finally:
        torch.set_num_threads(threads)
    return dirs


def checkpoint_answer_probs(dirs: dict[str, str]) -> dict[str, dict[str, float]]:
    """Mean p(right answer) of each checkpoint per domain over :func:`task_transcripts`."""
    from slime_ascend.rollout.torch_engine.model import build_byte_tokenizer, load_model

    tok = build_byte_tokenizer()
    examples = task_transcripts(tok)
    report: dict[str, dict[str, float]] = {}
    for name, path in dirs.items():
        model = load_model(path).float().eval()
        report[name] = {dom: round(_answer_prob(model, [e for e in examples if e.domain == dom]), 3) for dom in DOMAINS}
    return report

"""CompactionRL rollout: slime custom generate that runs an action/observation loop with compaction.

Use as ``--custom-generate-function-path slime_ascend.compaction.generate.generate``. Each call runs
one episode of the configured environment. When the trigger fires (``C - |h| < T_comp``, see
``context.should_compact``) the same policy writes a summary after the summary instruction, the
context is rebuilt as system ⊕ resume(summary) ⊕ last k pairs, and generation continues in a new
segment. The result is one ``Sample`` per segment (always a list), all sharing ``rollout_id``.

Per segment: ``tokens`` are exactly the ids sent to / returned by the engine; actions and summaries
have loss mask 1 and their rollout log-probs, everything else (prompt, resume, copied tail,
observations, summary request) has mask 0 and log-prob 0.0. ``metadata`` carries
``segment_index``, ``num_segments``, ``compaction=True`` and ``round_number`` (= segment index,
the one metadata key slime forwards to training).

Settings (``getattr(args, "ascend_compaction_<name>")``; ``None`` or absent means the default) are
listed in ``SETTINGS_DEFAULTS``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from slime_ascend.compaction.context import CompactionConfig, Pair, Segment, SegmentBuilder, Span, rebuild_context
from slime_ascend.compaction.context import should_compact, tail_pairs
from slime_ascend.compaction.env import Environment, make_env
from slime_ascend.compaction.plugin import ROLLOUT_SETTINGS
from slime_ascend.compaction.prompts import (
    load_resume_template,
    load_summary_prompt,
    make_turn_format,
    render_resume,
)
from slime_ascend.compat.sample import get_sample_class
from slime_ascend.rollout.engine_client import EngineClient, GenerationResult, generate_url_from_args

__all__ = [
    "SETTINGS_DEFAULTS",
    "CompactionRuntime",
    "CompactionSettings",
    "generate",
    "run_compaction_rollout",
    "set_episode_router",
    "set_runtime_override",
]

SETTINGS_PREFIX = "ascend_compaction_"
# name -> default, as the plugin declares them; context_budget None = args.rollout_max_context_len, else 32768;
# max_action_tokens None = sampling_params["max_new_tokens"].
SETTINGS_DEFAULTS: dict[str, Any] = {s.key.removeprefix(SETTINGS_PREFIX): s.default for s in ROLLOUT_SETTINGS}
FALLBACK_CONTEXT_BUDGET = 32768


@dataclass(frozen=True)
class CompactionSettings:
    context: CompactionConfig
    max_turns: int
    max_action_tokens: int | None
    summary_max_tokens: int
    env: str
    env_kwargs: dict[str, Any]
    env_reward: bool
    use_chat_template: bool
    summary_prompt_path: str | None
    resume_template_path: str | None

    @classmethod
    def from_args(cls, args: Any) -> CompactionSettings:
        def get(name: str) -> Any:
            value = getattr(args, SETTINGS_PREFIX + name, None)
            return SETTINGS_DEFAULTS[name] if value is None else value

        budget = get("context_budget") or getattr(args, "rollout_max_context_len", None) or FALLBACK_CONTEXT_BUDGET
        for name in ("max_turns", "summary_max_tokens"):
            if int(get(name)) < 1:
                raise ValueError(f"{SETTINGS_PREFIX}{name} must be >= 1; got {get(name)}")
        max_action = get("max_action_tokens")
        if max_action is not None and int(max_action) < 1:
            raise ValueError(f"{SETTINGS_PREFIX}max_action_tokens must be >= 1 or None; got {max_action}")
        env_kwargs = get("env_kwargs") or {}
        if not isinstance(env_kwargs, dict):
            raise TypeError(f"{SETTINGS_PREFIX}env_kwargs must be a mapping; got {type(env_kwargs).__name__}")
        return cls(
            context=CompactionConfig(
                budget=int(budget),
                trigger_tokens=int(get("trigger_tokens")),
                max_compactions=int(get("max_compactions")),
                keep_pairs=int(get("keep_pairs")),
            ),
            max_turns=int(get("max_turns")),
            max_action_tokens=None if max_action is None else int(max_action),
            summary_max_tokens=int(get("summary_max_tokens")),
            env=str(get("env")),
            env_kwargs=dict(env_kwargs),
            env_reward=bool(get("env_reward")),
            use_chat_template=bool(get("use_chat_template")),
            summary_prompt_path=get("summary_prompt_path"),
            resume_template_path=get("resume_template_path"),
        )


class Engine(Protocol):
    async def generate(self, input_ids: Sequence[int], sampling_params: dict[str, Any]) -> GenerationResult: ...


@dataclass
class CompactionRuntime:
    """What a rollout needs besides args: a tokenizer, an engine, and a fresh-environment factory.

    ``env_factory=None`` builds the environment from the settings (``ascend_compaction_env``).
    """

    tokenizer: Any
    engine: Engine
    env_factory: Callable[[], Environment] | None = None


_runtime_override: CompactionRuntime | None = None


def set_runtime_override(runtime: CompactionRuntime | None) -> None:
    """Process-wide test seam: ``generate`` uses ``runtime`` instead of loading tokenizer/engine from args."""
    global _runtime_override
    _runtime_override = runtime


@functools.cache
def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=True)


@functools.cache
def _engine_for_url(url: str) -> EngineClient:
    return EngineClient(url)


def _resolve_runtime(args: Any) -> CompactionRuntime:
    if _runtime_override is not None:
        return _runtime_override
    path = getattr(args, "hf_checkpoint", None)
    if not path:
        raise ValueError("args.hf_checkpoint is required to load the tokenizer for compaction rollouts")
    return CompactionRuntime(tokenizer=_load_tokenizer(str(path)), engine=_engine_for_url(generate_url_from_args(args)))


_episode_router: Callable[..., Any] | None = None


def set_episode_router(router: Callable[..., Any] | None) -> None:
    """Another plugin's placement of each episode (``cosched``'s sessions: every turn of an episode on the engine
    that owns its prefix): ``await router(run, args, sample, sampling_params, settings=..., runtime=...)`` runs the
    episode through ``run`` (:func:`run_compaction_rollout`), e.g. with another engine in ``runtime``. None: none."""
    global _episode_router
    _episode_router = router


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False) -> list[Any]:
    """slime custom generate: one compaction episode -> one Sample per segment (shared ``rollout_id``)."""
    settings, runtime = CompactionSettings.from_args(args), _resolve_runtime(args)
    if _episode_router is not None:
        return await _episode_router(run_compaction_rollout, args, sample, sampling_params, settings=settings,
                                     runtime=runtime)
    return await run_compaction_rollout(args, sample, sampling_params, settings=settings, runtime=runtime)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _turn_tokens(tokenizer: Any, text: str, after: Sequence[int]) -> list[int]:
    """Tokenize a turn; drop its first token when it repeats the special token that ``after`` ended with."""
    ids = _encode(tokenizer, text)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    if ids and after and ids[0] == after[-1] and ids[0] in special:
        ids = ids[1:]
    return ids


@dataclass
class _FinishedSegment:
    segment: Segment
    status: str  # Status member name
    weight_versions: list[str]


async def run_compaction_rollout(
    args: Any,
    sample: Any,
    sampling_params: dict[str, Any],
    *,
    settings: CompactionSettings,
    runtime: CompactionRuntime,
) -> list[Any]:
    """The episode loop behind :func:`generate`, with explicit settings and runtime."""
    status_cls = type(sample).Status
    if sample.status not in (status_cls.PENDING, status_cls.ABORTED):
        raise ValueError(f"compaction generate expects a PENDING or ABORTED sample; got {sample.status}")
    cfg = settings.context
    tok = runtime.tokenizer
    fmt = make_turn_format(tok, settings.use_chat_template)
    summary_prompt = load_summary_prompt(settings.summary_prompt_path)
    resume_template = load_resume_template(settings.resume_template_path)
    env = runtime.env_factory() if runtime.env_factory is not None else make_env(settings.env, settings.env_kwargs)

    metadata = sample.metadata or {}
    seed = metadata.get("seed", sample.index)
    task_text = env.reset(seed=seed, task=metadata.get("task", sample.prompt))
    system = env.system_prompt

    base_params = dict(sampling_params)
    action_cap = settings.max_action_tokens or base_params.get("max_new_tokens") or cfg.budget

    builder = SegmentBuilder(_encode(tok, fmt.initial_text(system, task_text)))
    pairs: list[Pair] = []  # pairs in the current context (copied tail first)
    new_pairs = 0
    versions: list[str] = []
    finished: list[_FinishedSegment] = []
    compactions = turns = 0
    reward: float | None = None
    info: dict[str, Any] = {}

    async def call(max_new: int) -> GenerationResult:
        result = await runtime.engine.generate(builder.tokens, {**base_params, "max_new_tokens": int(max_new)})
        if result.weight_version is not None:
            versions.append(result.weight_version)
        return result

    while True:
        room = cfg.budget - len(builder)
        if turns >= settings.max_turns or room <= 0:
            status = "TRUNCATED"
            break
        result = await call(min(action_cap, room))
        builder.append("action", result.token_ids, log_probs=result.log_probs)
        if result.finish_reason == "abort":
            status = "ABORTED"
            break
        turns += 1
        step = env.step(tok.decode(result.token_ids, skip_special_tokens=True))
        info = dict(step.info)
        if step.done:
            reward = step.reward
            status = "COMPLETED"
            break
        obs_tokens = _turn_tokens(tok, fmt.observation_text(step.observation), result.token_ids)
        pair = Pair(tuple(result.token_ids), tuple(obs_tokens))
        if should_compact(len(builder) + len(obs_tokens), cfg, compactions_done=compactions, new_pairs=new_pairs + 1):
            request = _turn_tokens(
                tok, fmt.observation_text(f"{step.observation}\n\n{summary_prompt}"), result.token_ids
            )
            summary_room = cfg.budget - len(builder) - len(request)
            if summary_room >= 1:
                builder.append("summary_request", request)
                summary = await call(min(settings.summary_max_tokens, summary_room))
                builder.append("summary", summary.token_ids, log_probs=summary.log_probs)
                if summary.finish_reason == "abort":
                    status = "ABORTED"
                    break
                finished.append(_FinishedSegment(builder.build(), "COMPLETED", versions))
                versions = []
                compactions += 1
                pairs.append(pair)
                summary_text = tok.decode(summary.token_ids, skip_special_tokens=True).strip()
                resume = render_resume(resume_template, task=task_text, summary=summary_text)
                prompt, spans = rebuild_context(_encode(tok, fmt.initial_text(system, resume)), pairs, cfg.keep_pairs)
                builder = SegmentBuilder(prompt, spans)
                pairs = tail_pairs(pairs, cfg.keep_pairs)
                new_pairs = 0
                continue
        if len(builder) + len(obs_tokens) >= cfg.budget:
            status = "TRUNCATED"  # no room for another action after this observation
            break
        builder.append("observation", obs_tokens)
        pairs.append(pair)
        new_pairs += 1

    finished.append(_FinishedSegment(builder.build(), status, versions))
    if not settings.env_reward or status == "ABORTED":
        final_reward = None
    else:
        final_reward = float(reward) if reward is not None else 0.0
    return _to_samples(sample, finished, tok, reward=final_reward, env_info=info)


_COPIED_FIELDS = (
    "group_index",
    "index",
    "prompt",
    "label",
    "session_id",
    "generate_function_path",
    "custom_rm_path",
    "train_metadata",
    "multimodal_inputs",
    "multimodal_train_inputs",
)


def _to_samples(sample: Any, finished: list[_FinishedSegment], tok: Any, *, reward: Any, env_info: dict) -> list[Any]:
    cls = type(sample) if hasattr(type(sample), "Status") else get_sample_class()
    rollout_id = sample.rollout_id if sample.rollout_id is not None else sample.index
    n = len(finished)
    out = []
    for i, part in enumerate(finished):
        seg = part.segment
        new = cls()
        for name in _COPIED_FIELDS:
            if hasattr(sample, name) and hasattr(new, name):
                setattr(new, name, getattr(sample, name))
        new.rollout_id = rollout_id
        new.tokens = list(seg.tokens)
        new.response_length = seg.response_length
        new.response = tok.decode(seg.tokens[seg.prompt_length :], skip_special_tokens=False)
        new.loss_mask = list(seg.loss_mask)
        new.rollout_log_probs = list(seg.rollout_log_probs)
        new.weight_versions = list(part.weight_versions)
        new.status = cls.Status[part.status]
        new.reward = reward
        new.metadata = {
            **(sample.metadata or {}),
            "segment_index": i,
            "num_segments": n,
            "compaction": True,
            "round_number": i,
            "compaction_spans": [_span_record(s) for s in seg.spans],
            "env_info": dict(env_info),
        }
        out.append(new)
    return out


def _span_record(span: Span) -> list[Any]:
    return [span.kind, span.start, span.end, int(span.trainable)]

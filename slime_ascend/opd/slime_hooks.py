"""slime hook contributions of the ``opd`` plugin (see :mod:`slime_ascend.opd.plugin`).

Rollout manager:

* :func:`teacher_reward` (``reward_model``): route, score at the routed teacher, return the task
  reward. The sliced teacher log-probs travel in ``sample.metadata["opd_teacher_log_probs"]``
  (and the routed name in ``sample.metadata["opd_teacher"]``).
* :func:`fill_teacher_log_probs` (``reward_post_process``, order 300): moves them to
  ``sample.teacher_log_probs`` (fp32 tensor, length ``response_length``, the same values slime's
  ``post_process_rewards`` produces), writes ``train_metadata["opd_teacher"/"opd_coef"]``, logs
  routing counts and per-teacher KL, and runs the same-origin check once.

Train actor:

* :func:`opd_advantage` (``advantage``, order 500): ``A = task_weight * A_task + coef_t * (logp_T -
  logp_S)`` on CP-local per-sample lists; ``logp_S`` as slime picks it (``log_probs``, or
  ``rollout_log_probs`` with ``--use-rollout-logprobs``).

Teacher endpoints, in this order: the teacher's ``url``; a frozen model of that name in
``--sglang-config`` (slime's ``get_model_url``); else the *switched* engine(s) of
``ascend_opd_switch_engine_urls``, which a :class:`~slime_ascend.opd.pool.TeacherPool` (in-process,
or the named Ray actor ``ascend_opd_pool_actor``) switches with ``/update_weights_from_disk``.
A :class:`SwitchGate` lets requests of the resident teacher run concurrently and switches only when
none is in flight, serving waiters first-come first-served by teacher, so one switch serves every
queued request of that teacher.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import inspect
import itertools
import logging
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..plugins import roles, runtime
from ..plugins.settings import SettingsError
from .router import DomainRouter, RoutingError
from .teachers import TeacherSpec, check_teacher_compatible, parse_teachers

__all__ = [
    "FORWARD_METADATA_PATCH",
    "SwitchGate",
    "OPDContext",
    "get_context",
    "reset_state",
    "validate",
    "build_score_payload",
    "response_teacher_log_probs",
    "teacher_reward",
    "slime_rule_reward",
    "fill_teacher_log_probs",
    "per_sample_coefs",
    "opd_advantage",
    "opd_rollout_metrics",
    "rollout_step_metrics",
    "opd_stats",
]

logger = logging.getLogger("slime_ascend.opd")

PLUGIN_NAME = "opd"
#: Runtime patch that forwards ``train_data["metadata"]`` (from ``Sample.train_metadata``) to the trainer.
FORWARD_METADATA_PATCH = "rollout.forward_metadata"
META_TEACHER = "opd_teacher"
META_LOG_PROBS = "opd_teacher_log_probs"
META_TOPK = "opd_topk"
TRAIN_META_COEF = "opd_coef"


# ------------------------------------------------------------------------------------------------
# start-up validation (every process)
# ------------------------------------------------------------------------------------------------
def _teachers(settings: Mapping[str, Any]) -> list[TeacherSpec]:
    raw = settings["ascend_opd_teachers"]
    if not raw:
        raise SettingsError(
            "setting ascend_opd_teachers is empty. Fix: add a teachers section to the YAML given to "
            "--custom-config-path, e.g. ascend_opd_teachers: [{name: math, checkpoint_dir: /ckpt/math, "
            "domains: [math], url: 'http://host:30000'}]"
        )
    try:
        return parse_teachers(raw)
    except ValueError as e:
        raise SettingsError(f"setting ascend_opd_teachers: {e}") from None


def validate(args: Any, settings: Mapping[str, Any]) -> None:
    """Refuse configurations that would silently train something else than multi-teacher OPD."""
    teachers = _teachers(settings)
    names = [t.name for t in teachers]
    default = settings["ascend_opd_default_teacher"]
    if default is not None and default not in names:
        raise SettingsError(
            f"setting ascend_opd_default_teacher={default!r} is not a configured teacher {names}. "
            "Fix: name one of the teachers, or unset it (then a sample without a route is an error)"
        )
    if settings["ascend_opd_mode"] == "topk":
        raise SettingsError(
            "setting ascend_opd_mode='topk': the MOPD top-k loss needs the teacher's top-k ids/log-probs in "
            "the loss batch, which stock slime neither forwards to the trainer nor puts in the batch "
            "(rollout.py _split_train_data_by_dp, model.py train_one_step key lists). Fix: use 'sampled'"
        )
    problems = []
    # slime gives the critic its own args with use_opd switched off (_apply_megatron_role_overrides): the
    # critic fits values and never sees teachers, so the pass-through rule is the actor's and the driver's
    critic = roles.train_role() == "critic"
    if not critic and not getattr(args, "use_opd", False):
        problems.append("use_opd must be true (slime then forwards and CP-slices teacher_log_probs and "
                        "recomputes the student log-probs before advantages)")
    if getattr(args, "opd_type", "sglang") != "sglang":
        problems.append(f"opd_type must be 'sglang' (teachers score at rollout time), got {args.opd_type!r}")
    if getattr(args, "opd_teacher_load", None) is not None:
        problems.append("opd_teacher_load must be unset (it loads slime's single megatron-mode teacher)")
    kl_coef = getattr(args, "opd_kl_coef", 0.0)
    if kl_coef not in (0, 0.0, None):
        problems.append(f"opd_kl_coef must be 0 (the opd plugin applies the per-teacher term), got {kl_coef!r}")
    if problems:
        raise SettingsError(
            "plugin 'opd' needs slime's own OPD switched to pass-through: " + "; ".join(problems)
            + ". Fix: keep use_opd: true, opd_type: sglang, opd_kl_coef: 0 from `slime-ascend config opd` "
            "and drop --opd-teacher-load / --opd-kl-coef from the command line"
        )
    switched = [t.name for t in teachers if t.url is None]
    if switched and not settings["ascend_opd_switch_engine_urls"] and not getattr(args, "sglang_config", None):
        raise SettingsError(
            f"teachers {switched} have no url, and neither ascend_opd_switch_engine_urls nor --sglang-config "
            "is set. Fix: give each teacher a url, host them as frozen models named like the teachers in "
            "--sglang-config, or set ascend_opd_switch_engine_urls to the engine that the pool switches"
        )


# ------------------------------------------------------------------------------------------------
# switching gate
# ------------------------------------------------------------------------------------------------
class SwitchGate:
    """Serialise access to one engine that holds one teacher at a time.

    Requests for the resident teacher run concurrently. A request for another teacher waits until
    nothing is in flight; then the teacher of the *oldest* waiting request is switched in and every
    request queued for it at that moment enters. A request for the resident teacher that arrives
    after a request for another teacher queues behind it (first come, first served by teacher: no
    starvation; each switch serves a whole batch).

    Args:
        switch: ``async fn(name)`` that makes ``name`` resident (raises on failure).
        prefetch: optional ``async fn(name)`` called after a switch with the next teacher waited for.
    """

    def __init__(
        self,
        switch: Callable[[str], Awaitable[Any]],
        prefetch: Callable[[str], Awaitable[Any]] | None = None,
        active: str | None = None,
    ) -> None:
        self._switch = switch
        self._prefetch = prefetch
        self.active = active
        self.inflight = 0
        self.switches = 0
        self.wait_s = 0.0
        self._queue: OrderedDict[int, str] = OrderedDict()
        self._tickets = itertools.count()
        self._batch_end = -1
        self._cond = asyncio.Condition()

    def _oldest_other(self, name: str) -> int | None:
        for ticket, other in self._queue.items():
            if other != name:
                return ticket
        return None

    @contextlib.asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[None]:
        t0 = time.perf_counter()
        async with self._cond:
            ticket = next(self._tickets)
            self._queue[ticket] = name
            try:
                while True:
                    if self.active == name:
                        other = self._oldest_other(name)
                        if ticket <= self._batch_end or other is None or other > ticket:
                            break
                    elif self.inflight == 0 and next(iter(self._queue.values())) == name:
                        await self._switch(name)  # holding the lock: nobody enters during a switch
                        self.active = name
                        self.switches += 1
                        self._batch_end = next(reversed(self._queue))  # everyone queued for it now enters
                        self._cond.notify_all()
                        nxt = self._oldest_other(name)
                        if nxt is not None and self._prefetch is not None:
                            await self._prefetch(self._queue[nxt])
                        continue
                    await self._cond.wait()
            finally:
                del self._queue[ticket]
                self._cond.notify_all()  # a failed switch must not leave the others waiting
            self.inflight += 1
            self.wait_s += time.perf_counter() - t0
        try:
            yield
        finally:
            async with self._cond:
                self.inflight -= 1
                self._cond.notify_all()


class _PoolSwitcher:
    """Switch the engines of ``ascend_opd_switch_engine_urls`` through a TeacherPool (local or Ray actor)."""

    def __init__(self, teachers: Sequence[TeacherSpec], settings: Mapping[str, Any], student: Mapping[str, Any]):
        from .pool import SGLangEngineLoader

        urls = list(settings["ascend_opd_switch_engine_urls"])
        factory = functools.partial(SGLangEngineLoader, urls, stage_dir=settings["ascend_opd_stage_dir"])
        specs = [t.to_dict() for t in teachers]
        self.prefetch_enabled = bool(settings["ascend_opd_prefetch"])
        self.actor_name = settings["ascend_opd_pool_actor"]
        self._local = None
        self._actor = None
        self._ray = None
        if self.actor_name:
            import ray

            from .pool import make_teacher_pool_actor

            self._actor = make_teacher_pool_actor().options(
                name=self.actor_name, get_if_exists=True, max_concurrency=1
            ).remote(specs, factory, **student)
            self._ray = ray
        else:
            from .pool import TeacherPool

            self._local = TeacherPool(specs, factory(), **student)
        if self.prefetch_enabled:
            # stage the first switched teacher while the first rollout generates, so that the first
            # switch is a prefetch hit rather than a cold copy in the scoring path
            self.set_schedule([t.name for t in teachers])

    def set_schedule(self, names: Sequence[str]) -> None:
        if self._actor is not None:
            self._actor.set_schedule.remote(list(names))  # fire and forget; the actor runs it in order
        else:
            self._local.set_schedule(list(names))

    async def activate(self, name: str) -> None:
        if self._actor is not None:
            await self._actor.activate.remote(name)
        else:
            await asyncio.to_thread(self._local.activate, name)

    async def prefetch(self, name: str) -> None:
        if not self.prefetch_enabled:
            return
        if self._actor is not None:
            self._actor.prefetch.remote(name)  # fire and forget; the actor runs it in order
        else:
            self._local.prefetch(name)

    def metrics(self) -> dict[str, Any]:
        if self._actor is not None:
            return dict(self._ray.get(self._actor.metrics.remote()))
        return self._local.metrics()


# ------------------------------------------------------------------------------------------------
# per-process context
# ------------------------------------------------------------------------------------------------
@dataclass
class OPDContext:
    """Per-process state of the plugin: parsed teachers, router, switching, counters."""

    settings: Mapping[str, Any]
    teachers: list[TeacherSpec]
    router: DomainRouter
    coefs: dict[str, float]
    switcher: _PoolSwitcher | None = None
    gates: dict[int, SwitchGate] = field(default_factory=dict)
    requests: Counter = field(default_factory=Counter)
    request_s: Counter = field(default_factory=Counter)
    request_retries: int = 0
    post_process_calls: int = 0
    same_origin: dict[str, Any] | None = None
    last_step: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def uniform_coef(self) -> float | None:
        values = set(self.coefs.values())
        return values.pop() if len(values) == 1 else None

    def gate(self) -> SwitchGate:
        loop = asyncio.get_running_loop()
        key = id(loop)
        with self.lock:
            gate = self.gates.get(key)
            if gate is None:
                if self.switcher is None:
                    raise RuntimeError("no switched teacher engine configured (ascend_opd_switch_engine_urls)")
                gate = SwitchGate(self.switcher.activate, self.switcher.prefetch)
                self.gates[key] = gate
            return gate


_CONTEXTS: dict[int, OPDContext] = {}
_CONTEXTS_LOCK = threading.Lock()


def reset_state() -> None:
    """Forget per-process contexts (tests)."""
    with _CONTEXTS_LOCK:
        _CONTEXTS.clear()
        _RULE_ARGS.clear()


def _student_info(args: Any) -> dict[str, Any]:
    student_dir = getattr(args, "hf_checkpoint", None)
    info: dict[str, Any] = {}
    vocab = getattr(args, "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0:
        info["student_vocab_size"] = vocab
    if isinstance(student_dir, str) and student_dir:
        from pathlib import Path

        if Path(student_dir).is_dir():
            info["student_dir"] = student_dir
    return info


def coefs_differ(args: Any) -> bool:
    """Condition of opd's runtime patches (``rollout.forward_metadata``, ``train.rollout_log_metadata``):
    teachers with different coefficients need each sample's coefficient in the trainer."""
    settings = runtime.settings(args, PLUGIN_NAME)
    default = settings["ascend_opd_coef"]
    return len({t.effective_coef(default) for t in _teachers(settings)}) > 1


def get_context(args: Any, *, rollout_side: bool = False) -> OPDContext:
    """The plugin's state in this process, built at first use from ``args``.

    On the rollout side each teacher is also checked against the student (vocab size, tokenizer
    files: a mismatch raises :class:`~slime_ascend.opd.teachers.TeacherMismatchError`), and the
    teacher pool for switched teachers is created.
    """
    key = id(args)
    with _CONTEXTS_LOCK:
        ctx = _CONTEXTS.get(key)
    if ctx is not None:
        if rollout_side and ctx.switcher is None and ctx.settings["ascend_opd_switch_engine_urls"]:
            ctx.switcher = _make_switcher(args, ctx)
        return ctx
    settings = runtime.settings(args, PLUGIN_NAME)
    teachers = _teachers(settings)
    router = DomainRouter(
        teachers,
        domain_key=settings["ascend_opd_domain_key"],
        default_teacher=settings["ascend_opd_default_teacher"],
        default_coef=settings["ascend_opd_coef"],
    )
    coefs = {t.name: router.coef_for(t.name) for t in teachers}
    ctx = OPDContext(settings, teachers, router, coefs)
    if rollout_side:
        student = _student_info(args)
        for t in teachers:  # refuse vocab / tokenizer mismatches before the first request
            check_teacher_compatible(t, **student)
        if settings["ascend_opd_switch_engine_urls"]:
            ctx.switcher = _make_switcher(args, ctx)
    with _CONTEXTS_LOCK:
        ctx = _CONTEXTS.setdefault(key, ctx)
    return ctx


def _make_switcher(args: Any, ctx: OPDContext) -> _PoolSwitcher | None:
    routers = getattr(args, "sglang_model_routers", None) or {}
    switched = [t for t in ctx.teachers if t.url is None and t.name not in routers]
    if not switched:
        return None
    return _PoolSwitcher(switched, ctx.settings, _student_info(args))


# ------------------------------------------------------------------------------------------------
# scoring
# ------------------------------------------------------------------------------------------------
def build_score_payload(args: Any, sample: Any, top_k: int | None = None) -> dict[str, Any]:
    """SGLang ``/generate`` request that scores ``sample.tokens`` without generating (as slime's OPD RM)."""
    payload: dict[str, Any] = {
        "input_ids": list(sample.tokens),
        "sampling_params": {
            "temperature": getattr(args, "rollout_temperature", 1.0),
            "max_new_tokens": 0,
            "skip_special_tokens": False,
        },
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if top_k:
        payload["top_logprobs_num"] = int(top_k)
    mm = getattr(sample, "multimodal_inputs", None)
    if mm and mm.get("images"):
        from slime.utils.processing_utils import encode_image_for_rollout_engine

        payload["image_data"] = [encode_image_for_rollout_engine(image) for image in mm["images"]]
    return payload


def response_teacher_log_probs(response: Mapping[str, Any], response_length: int, teacher: str = "?") -> list[float]:
    """``meta_info.input_token_logprobs[1:]`` (first element of each entry), last ``response_length``.

    This is exactly what slime's ``post_process_rewards`` keeps.
    """
    try:
        entries = response["meta_info"]["input_token_logprobs"]
    except (KeyError, TypeError):
        raise ValueError(
            f"teacher {teacher!r}: reply has no meta_info.input_token_logprobs; the endpoint must be an SGLang "
            "/generate that honours return_logprob and logprob_start_len=0"
        ) from None
    values = [item[0] for item in entries[1:]]
    if response_length > len(values):
        raise ValueError(
            f"teacher {teacher!r}: scored {len(values)} positions but the response has {response_length} tokens"
        )
    out = values[len(values) - response_length :] if response_length else []
    bad = [i for i, v in enumerate(out) if v is None or not math.isfinite(float(v))]
    if bad:
        raise ValueError(f"teacher {teacher!r}: non-finite log-prob at response position {bad[0]}")
    return [float(v) for v in out]


async def _post_json(url: str, payload: dict[str, Any], timeout_s: float, retries: int, ctx: OPDContext) -> Any:
    from ..json_client import arequest_json

    def count_retry() -> None:
        ctx.request_retries += 1

    return await arequest_json(url, payload, timeout_s=timeout_s, retries=retries, on_retry=count_retry)


def _teacher_url(args: Any, spec: TeacherSpec) -> str | None:
    if spec.url is not None:
        return spec.url.rstrip("/") + "/generate"
    routers = getattr(args, "sglang_model_routers", None) or {}
    if spec.name in routers:
        from slime.rollout.sglang_rollout import get_model_url

        return get_model_url(args, spec.name, "/generate")
    return None


_rr = itertools.count()


async def _score(args: Any, ctx: OPDContext, spec: TeacherSpec, sample: Any) -> Any:
    s = ctx.settings
    top_k = s["ascend_opd_topk"] if s["ascend_opd_mode"] == "topk" else None
    payload = build_score_payload(args, sample, top_k)
    timeout, retries = s["ascend_opd_request_timeout_s"], s["ascend_opd_request_retries"]
    t0 = time.perf_counter()
    url = _teacher_url(args, spec)
    if url is not None:
        resp = await _post_json(url, payload, timeout, retries, ctx)
    else:
        urls = s["ascend_opd_switch_engine_urls"]
        if not urls:
            raise RuntimeError(f"teacher {spec.name!r} has no url, no --sglang-config model and no switched engine")
        async with ctx.gate().use(spec.name):
            url = urls[next(_rr) % len(urls)].rstrip("/") + "/generate"
            resp = await _post_json(url, payload, timeout, retries, ctx)
    ctx.requests[spec.name] += 1
    ctx.request_s[spec.name] += time.perf_counter() - t0
    return resp


async def _task_reward(args: Any, ctx: OPDContext, sample: Any, **kwargs: Any) -> Any:
    path = ctx.settings["ascend_opd_task_rm_path"]
    if not path:
        return 0.0
    from ..plugins.base import resolve

    out = resolve(path)(args, sample, **kwargs)
    return await out if inspect.isawaitable(out) else out


async def slime_rule_reward(args: Any, sample: Any, **kwargs: Any) -> Any:
    """Task reward from slime's own rule-based reward models (``--rm-type``), for ``ascend_opd_task_rm_path``.

    With the ``opd`` plugin ``--custom-rm-path`` is our dispatcher, so slime's ``async_rm`` would call it
    back instead of applying ``--rm-type``; this calls ``async_rm`` with the custom path cleared on a
    shallow copy of ``args`` (made once per ``args``).
    """
    from slime.rollout.rm_hub import async_rm

    key = id(args)
    with _CONTEXTS_LOCK:
        base = _RULE_ARGS.get(key)
        if base is None:
            base = copy.copy(args)
            base.custom_rm_path = None
            _RULE_ARGS[key] = base
    if not (getattr(base, "rm_type", None) or "").strip() and not (
        isinstance(getattr(sample, "metadata", None), dict) and sample.metadata.get("rm_type")
    ):
        raise ValueError(
            "ascend_opd_task_rm_path is slime_rule_reward but --rm-type is not set. Fix: pass --rm-type "
            "(e.g. math, deepscaler, dapo), or unset ascend_opd_task_rm_path for pure distillation (reward 0.0)"
        )
    return await async_rm(base, sample, **kwargs)


_RULE_ARGS: dict[int, Any] = {}


async def _reward_one(args: Any, ctx: OPDContext, sample: Any, **kwargs: Any) -> Any:
    if getattr(sample, "metadata", None) is None:
        sample.metadata = {}
    spec = ctx.router.route(sample.metadata, sample_id=getattr(sample, "index", None))
    scored, reward = await asyncio.gather(_score(args, ctx, spec, sample), _task_reward(args, ctx, sample, **kwargs))
    sample.metadata[META_TEACHER] = spec.name
    sample.metadata[META_LOG_PROBS] = response_teacher_log_probs(scored, sample.response_length, spec.name)
    if ctx.settings["ascend_opd_mode"] == "topk":
        from ..algorithms.opd import topk_payload_from_sglang

        sample.metadata[META_TOPK] = topk_payload_from_sglang(
            scored["meta_info"]["input_top_logprobs"], sample.response_length, ctx.settings["ascend_opd_topk"]
        )
    return reward


async def teacher_reward(args: Any, sample: Any, **kwargs: Any) -> Any:
    """``reward_model`` contribution: route and score at the teacher; returns the task reward.

    Accepts one sample or, for slime's batched / group RM calls, a list (returns a list).
    """
    ctx = get_context(args, rollout_side=True)
    if isinstance(sample, list):
        return list(await asyncio.gather(*(_reward_one(args, ctx, s, **kwargs) for s in sample)))
    return await _reward_one(args, ctx, sample, **kwargs)


# ------------------------------------------------------------------------------------------------
# reward post-process
# ------------------------------------------------------------------------------------------------
def fill_teacher_log_probs(args: Any, samples: list[Any], raw_rewards: list[Any], rewards: list[Any]):
    """``reward_post_process`` contribution (order 300); rewards pass through unchanged."""
    import torch

    ctx = get_context(args, rollout_side=True)
    counts: Counter[str] = Counter()
    kl_sum: Counter[str] = Counter()
    kl_tokens: Counter[str] = Counter()
    for i, sample in enumerate(samples):
        md = sample.metadata if isinstance(getattr(sample, "metadata", None), dict) else {}
        lps = md.pop(META_LOG_PROBS, None)
        name = md.get(META_TEACHER)
        if lps is None:
            if getattr(sample, "teacher_log_probs", None) is not None and name is not None:
                lps = sample.teacher_log_probs  # already filled (e.g. a re-run post-process)
            elif getattr(sample, "remove_sample", False):
                # dropped sample (loss mask zero): a neutral value keeps the batch rectangular per key
                ref = getattr(sample, "rollout_log_probs", None)
                lps = list(ref) if ref is not None else [0.0] * sample.response_length
                name = name or ctx.router.default_teacher or ctx.teachers[0].name
            else:
                raise ValueError(
                    f"sample {getattr(sample, 'index', i)!r} has no teacher log-probs: it was not scored by the opd "
                    "reward model (is --custom-rm-path the slime_ascend dispatcher, and did the RM run?)"
                )
        t = torch.as_tensor(lps, dtype=torch.float32).flatten()
        if t.numel() != sample.response_length:
            raise ValueError(
                f"sample {getattr(sample, 'index', i)!r}: {t.numel()} teacher log-probs for response_length "
                f"{sample.response_length}"
            )
        sample.teacher_log_probs = t
        tm = dict(sample.train_metadata or {})
        tm[META_TEACHER] = name
        tm[TRAIN_META_COEF] = ctx.coefs[name]
        sample.train_metadata = tm
        counts[name] += 1
        student = getattr(sample, "rollout_log_probs", None)
        if student is not None and len(student) == t.numel() and not getattr(sample, "remove_sample", False):
            from .same_origin import per_token_kl

            mask = torch.ones_like(t) if sample.loss_mask is None else torch.as_tensor(sample.loss_mask, dtype=t.dtype)
            kl = per_token_kl(torch.as_tensor(student, dtype=torch.float32), t, "k3")
            kl_sum[name] += float((kl * mask).sum())
            kl_tokens[name] += int(mask.sum())
    per_teacher_kl = {n: kl_sum[n] / kl_tokens[n] for n in kl_tokens if kl_tokens[n] > 0}
    with ctx.lock:
        ctx.post_process_calls += 1
        ctx.last_step = {"counts": dict(counts), "kl_k3": per_teacher_kl}
        first = ctx.post_process_calls == 1
    logger.info("opd routing this step: %s; per-teacher KL(student||teacher) k3: %s", dict(counts),
                {n: round(v, 5) for n, v in per_teacher_kl.items()})
    from ..plugins.rollout_metrics import report

    report(args, logger, "opd", rollout_step_metrics(ctx, counts, per_teacher_kl))
    if first and ctx.settings["ascend_opd_same_origin_check"]:
        _same_origin_once(ctx, kl_sum, kl_tokens)
    return raw_rewards, rewards


_POOL_KEYS = ("switches", "prefetch_started", "prefetch_hits", "prefetch_late", "prefetch_misses", "cold_loads",
              "stage_retries", "stage_failures", "failed_teachers", "stall_s")


def rollout_step_metrics(ctx: OPDContext, counts: Mapping[str, int], kl: Mapping[str, float]) -> dict[str, float]:
    """This rollout's routing and teacher-pool figures, as ``rollout/*`` keys for slime's rollout metric path:
    ``rollout/opd_samples/<teacher>`` (samples routed to it; every configured teacher),
    ``rollout/opd_kl_k3/<teacher>`` (mean per-token KL(student||teacher), k3) and, with a switched-teacher
    pool, its counters since start as ``rollout/opd_pool/<counter>`` (switches, prefetch started / hits /
    late / misses, cold loads, stage retries / failures, failed teachers, stall seconds)."""
    out: dict[str, float] = {f"rollout/opd_samples/{n}": int(counts.get(n, 0)) for n in ctx.coefs}
    out.update({f"rollout/opd_kl_k3/{n}": float(v) for n, v in kl.items()})
    if ctx.switcher is not None:
        pool = ctx.switcher.metrics()
        out.update({f"rollout/opd_pool/{k}": (float(pool[k]) if k == "stall_s" else int(pool[k]))
                    for k in _POOL_KEYS if k in pool})
    return out


def _same_origin_once(ctx: OPDContext, kl_sum: Mapping[str, float], kl_tokens: Mapping[str, int]) -> None:
    from .same_origin import report_from_kls

    if not kl_tokens:
        logger.warning("opd same-origin check skipped: samples carry no rollout_log_probs to compare with")
        return
    s = ctx.settings
    report = report_from_kls(
        {n: kl_sum[n] / kl_tokens[n] for n in kl_tokens if kl_tokens[n] > 0},
        dict(kl_tokens),
        threshold_ratio=s["ascend_opd_same_origin_ratio"],
        max_kl=s["ascend_opd_same_origin_max_kl"],
        estimator="k3",
        warn=True,
    )
    ctx.same_origin = report.to_dict()
    logger.info("opd same-origin check: %s", {n: round(t.kl, 5) for n, t in report.teachers.items()})
    if report.flagged and s["ascend_opd_same_origin_action"] == "error":
        raise RuntimeError("opd same-origin check failed: " + "; ".join(report.warnings))


# ------------------------------------------------------------------------------------------------
# advantage (train actor)
# ------------------------------------------------------------------------------------------------
def per_sample_coefs(ctx: OPDContext, rollout_data: Mapping[str, Any], n: int) -> list[float]:
    """Each local sample's teacher coefficient: from the forwarded ``metadata`` when present, else
    the single coefficient all teachers share (else an error naming the fix)."""
    metadata = rollout_data.get("metadata")
    if metadata is not None:
        if len(metadata) != n:
            raise ValueError(f"rollout_data['metadata'] has {len(metadata)} entries for {n} samples")
        out = []
        for i, md in enumerate(metadata):
            if not isinstance(md, Mapping) or TRAIN_META_COEF not in md:
                break
            out.append(float(md[TRAIN_META_COEF]))
        else:
            return out
    coef = ctx.uniform_coef
    if coef is None:
        raise RuntimeError(
            f"teachers have different coefficients {ctx.coefs}, but rollout_data carries no per-sample "
            f"'metadata' with {TRAIN_META_COEF!r}: the runtime patch {FORWARD_METADATA_PATCH!r} is not active in "
            "the rollout manager. Fix: export SLIME_ASCEND_PLUGINS with opd to the driver and to `ray start`, so "
            "slime-ascend installs it as the RolloutManager starts (or give every teacher the same coef)"
        )
    return [coef] * n


def opd_advantage(args: Any, rollout_data: dict[str, Any]) -> None:
    """``advantage`` contribution (order 500): ``A = task_weight * A + coef_t * (logp_T - logp_S)``."""
    from ..algorithms.opd import opd_advantages_per_sample

    ctx = get_context(args)
    if rollout_data.get("advantages") is None:
        raise RuntimeError("opd advantage: no base advantages; it runs in the advantage chain after its base "
                           "(slime_ascend.hooks.advantage_function runs slime's estimator when no plugin does)")
    student = rollout_data.get("rollout_log_probs") if getattr(args, "use_rollout_logprobs", False) else (
        rollout_data.get("log_probs")
    )
    if student is None:
        raise RuntimeError(
            "opd advantage: no student log-probs in rollout_data ('log_probs'; 'rollout_log_probs' with "
            "--use-rollout-logprobs). Fix: keep use_opd: true so slime recomputes them before advantages"
        )
    teacher = rollout_data.get("teacher_log_probs")
    if teacher is None:
        raise RuntimeError("opd advantage: rollout_data has no 'teacher_log_probs' (did the opd reward hooks run?)")
    advantages = rollout_data["advantages"]
    coefs = per_sample_coefs(ctx, rollout_data, len(student))
    new_adv, reverse_kls = opd_advantages_per_sample(
        teacher,
        student,
        coefs,
        task_advantages=advantages,
        task_weight=ctx.settings["ascend_opd_task_weight"],
        clip=ctx.settings["ascend_opd_clip"],
    )
    if rollout_data.get("returns") is advantages:
        # slime's reinforce_plus_plus_baseline returns the advantages list itself as returns, so its
        # in-place OPD update reaches the returns too; keep that identity
        rollout_data["returns"] = new_adv
    rollout_data["advantages"] = new_adv
    rollout_data["opd_reverse_kl"] = reverse_kls
    rollout_data.update(opd_rollout_metrics(ctx, rollout_data, coefs))


def opd_rollout_metrics(ctx: OPDContext, rollout_data: Mapping[str, Any], coefs: Sequence[float]) -> dict[str, list]:
    """Per-sample columns that slime's train-side ``log_rollout_data`` reports as step metrics (each list
    averaged over the rollout's samples): ``rollout/opd_coef`` (the coefficient applied) and, when each
    sample's teacher was forwarded, ``rollout/opd_share/<teacher>`` (the fraction routed to it). Every
    DP rank emits the same keys (one per configured teacher), as slime's gather requires."""
    if not coefs:
        return {}
    out: dict[str, list] = {"opd_coef": [float(c) for c in coefs]}
    metadata = rollout_data.get("metadata")
    if metadata is not None and len(metadata) == len(coefs):
        names = [md.get(META_TEACHER) if isinstance(md, Mapping) else None for md in metadata]
        if all(n is not None for n in names):
            for teacher in ctx.coefs:
                out[f"opd_share/{teacher}"] = [1.0 if n == teacher else 0.0 for n in names]
    return out


# ------------------------------------------------------------------------------------------------
# stats
# ------------------------------------------------------------------------------------------------
def opd_stats(args: Any = None) -> dict[str, Any]:
    """Routing counts (cumulative and last step), requests and latency per teacher, switches, stall,
    pool metrics and the same-origin report of this process's context(s)."""
    with _CONTEXTS_LOCK:
        contexts = list(_CONTEXTS.items())
    if args is not None:
        contexts = [(k, c) for k, c in contexts if k == id(args)]
    out: dict[str, Any] = {}
    for _, ctx in contexts:
        gates = list(ctx.gates.values())
        out = {
            "routing": ctx.router.stats(),
            "last_step": dict(ctx.last_step),
            "requests": dict(ctx.requests),
            "request_mean_s": {n: ctx.request_s[n] / ctx.requests[n] for n in ctx.requests if ctx.requests[n]},
            "request_retries": ctx.request_retries,
            "switches": sum(g.switches for g in gates),
            "gate_wait_s": sum(g.wait_s for g in gates),
            "pool": ctx.switcher.metrics() if ctx.switcher is not None else None,
            "same_origin": ctx.same_origin,
            "coefs": dict(ctx.coefs),
        }
    return out


__all__ += ["RoutingError"]

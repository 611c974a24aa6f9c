"""The ``opd`` plugin's state in each process: teachers, router, coefficients, teacher pool, counters
(built at first use from slime's ``args``; :func:`get_context`), and :func:`opd_stats`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..plugins import runtime
from ..plugins.settings import SettingsError
from .router import DomainRouter
from .switching import SwitchGate, _PoolSwitcher
from .teachers import TeacherSpec, parse_teachers

logger = logging.getLogger("slime_ascend.opd")

PLUGIN_NAME = "opd"
#: Runtime patch that forwards ``train_data["metadata"]`` (from ``Sample.train_metadata``) to the trainer.
FORWARD_METADATA_PATCH = "rollout.forward_metadata"
META_TEACHER = "opd_teacher"
META_LOG_PROBS = "opd_teacher_log_probs"
META_TOPK = "opd_topk"
TRAIN_META_COEF = "opd_coef"
#: ``Sample.train_metadata`` key of the teacher's top-k payload (``algorithms.opd.pack_topk_payload``) in topk mode.
TRAIN_META_TOPK = "opd_topk"
#: Runtime patch that puts the forwarded ``metadata`` into the loss batch (topk mode).
LOSS_BATCH_PATCH = "train.loss_batch_metadata"


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
    #: the first switched teacher other than the resident one that this rollout's samples asked for (prefetched)
    hint: str | None = None
    scoring_loop: asyncio.AbstractEventLoop | None = None

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

    def resident(self) -> str | None:
        """The switched engine's teacher as the grouped scoring left it (None before the first switch)."""
        loop = self.scoring_loop
        gate = self.gates.get(id(loop)) if loop is not None else None
        return gate.active if gate is not None else None

    def note_deferred(self, name: str) -> None:
        """A sample for switched teacher ``name`` waits for the rollout's grouped scoring: the first teacher
        other than the resident one asked for in a rollout is prefetched now, while generation goes on."""
        if self.switcher is None or name == self.resident():
            return
        with self.lock:
            if self.hint is not None:
                return
            self.hint = name
        self.switcher.prefetch_now(name)

    def take_hint(self) -> str | None:
        """The teacher :meth:`note_deferred` prefetched this rollout (scored right after the resident one); resets it."""
        with self.lock:
            hint, self.hint = self.hint, None
        return hint

    def run_scoring(self, coro: Any) -> Any:
        """Run ``coro`` on this context's scoring loop (one thread, kept for the process: the switch gate and
        its resident teacher, and the HTTP connections, live across rollouts) and wait for its result."""
        with self.lock:
            if self.scoring_loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="opd-scoring", daemon=True).start()
                self.scoring_loop = loop
        return asyncio.run_coroutine_threadsafe(coro, self.scoring_loop).result()


_CONTEXTS: dict[int, OPDContext] = {}

_CONTEXTS_LOCK = threading.Lock()
# slime_rule_reward's args copies (custom RM cleared), one per args
_RULE_ARGS: dict[int, Any] = {}


def reset_state() -> None:
    """Forget per-process contexts (tests)."""
    with _CONTEXTS_LOCK:
        for ctx in _CONTEXTS.values():
            if ctx.scoring_loop is not None:
                ctx.scoring_loop.call_soon_threadsafe(ctx.scoring_loop.stop)
        _CONTEXTS.clear()
        _RULE_ARGS.clear()
    from .compat import clear_cache

    clear_cache()


def rule_args(args: Any) -> Any:
    """A shallow copy of ``args`` with the custom reward path cleared, made once per ``args`` (for
    :func:`slime_ascend.opd.hooks.slime_rule_reward`, which must reach slime's ``--rm-type`` rules)."""
    import copy

    with _CONTEXTS_LOCK:
        base = _RULE_ARGS.get(id(args))
        if base is None:
            base = _RULE_ARGS[id(args)] = copy.copy(args)
            base.custom_rm_path = None
    return base


def _student_info(args: Any) -> dict[str, Any]:
    student_dir = getattr(args, "hf_checkpoint", None)
    info: dict[str, Any] = {}
    vocab = getattr(args, "vocab_size", None)
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0:
        info["student_vocab_size"] = vocab
    if isinstance(student_dir, str) and os.path.isdir(student_dir):
        info["student_dir"] = student_dir
    return info

def coefs_differ(args: Any) -> bool:
    """Condition of opd's runtime patches (``rollout.forward_metadata``, ``train.rollout_log_metadata``):
    teachers with different coefficients need each sample's coefficient in the trainer."""
    settings = runtime.settings(args, PLUGIN_NAME)
    default = settings["ascend_opd_coef"]
    return len({t.effective_coef(default) for t in _teachers(settings)}) > 1

def topk_mode(args: Any) -> bool:
    """``ascend_opd_mode: topk`` (condition of ``train.loss_batch_metadata``): the loss reads each sample's
    teacher top-k payload from the loss batch's forwarded metadata."""
    return runtime.settings(args, PLUGIN_NAME)["ascend_opd_mode"] == "topk"


def needs_metadata(args: Any) -> bool:
    """Condition of ``rollout.forward_metadata`` / ``train.rollout_log_metadata``: the trainer needs per-sample
    facts, i.e. teachers' coefficients differ (:func:`coefs_differ`) or the top-k payload travels."""
    return topk_mode(args) or coefs_differ(args)


def get_context(args: Any, *, rollout_side: bool = False) -> OPDContext:
    """The plugin's state in this process, built at first use from ``args``.

    On the rollout side the teacher pool for switched teachers is created. (Each teacher was checked
    against the student when the settings were validated in this process: :func:`.hooks.validate`.)
    """
    key = id(args)
    with _CONTEXTS_LOCK:
        ctx = _CONTEXTS.get(key)
    if ctx is None:
        settings = runtime.settings(args, PLUGIN_NAME)
        teachers = _teachers(settings)
        router = DomainRouter(
            teachers,
            domain_key=settings["ascend_opd_domain_key"],
            default_teacher=settings["ascend_opd_default_teacher"],
            default_coef=settings["ascend_opd_coef"],
        )
        coefs = {t.name: router.coef_for(t.name) for t in teachers}
        with _CONTEXTS_LOCK:
            ctx = _CONTEXTS.setdefault(key, OPDContext(settings, teachers, router, coefs))
    if rollout_side and ctx.switcher is None and ctx.settings["ascend_opd_switch_engine_urls"]:
        ctx.switcher = _make_switcher(args, ctx)
    return ctx

def switched_teachers(args: Any, teachers: Sequence[TeacherSpec]) -> list[TeacherSpec]:
    """The teachers the pool switches on ``ascend_opd_switch_engine_urls``: no url of their own and no model of
    slime's ``--sglang-config`` (``args.sglang_model_routers``)."""
    routers = getattr(args, "sglang_model_routers", None) or {}
    return [t for t in teachers if t.url is None and t.name not in routers]


def _make_switcher(args: Any, ctx: OPDContext) -> _PoolSwitcher | None:
    switched = switched_teachers(args, ctx.teachers)
    if not switched:
        return None
    return _PoolSwitcher(switched, ctx.settings,
                         {**_student_info(args), "compat_check": ctx.settings["ascend_opd_compat_check"]})

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

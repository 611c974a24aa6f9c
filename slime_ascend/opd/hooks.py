"""The ``opd`` plugin's hook code: what slime's hooks call (see :mod:`slime_ascend.opd.plugin`).

Rollout manager:

* :func:`teacher_reward` (``reward_model``): route, score at the routed teacher, return the task
  reward. The sliced teacher log-probs travel in ``sample.metadata["opd_teacher_log_probs"]``
  (and the routed name in ``sample.metadata["opd_teacher"]``). A sample routed to a *switched*
  teacher is only routed here (``metadata["opd_pending_teacher"]``): it is scored with its rollout.
* :func:`fill_teacher_log_probs` (``reward_post_process``, order 300): first scores the rollout's
  samples that wait for a switched teacher, grouped by teacher with the resident one first (at
  most one switch per teacher the rollout needs; :mod:`.switching` says why there); then moves the log-probs to
  ``sample.teacher_log_probs`` (fp32 tensor, length ``response_length``, the same values slime's
  ``post_process_rewards`` produces), writes ``train_metadata["opd_teacher"/"opd_coef"]``, logs
  routing counts and per-teacher KL, and runs the same-origin check once.

Train actor:

* :func:`opd_advantage` (``advantage``, order 500): ``A = task_weight * A_task + coef_t * (logp_T -
  logp_S)`` on CP-local per-sample lists; ``logp_S`` as slime picks it (``log_probs``, or
  ``rollout_log_probs`` with ``--use-rollout-logprobs``).

The jobs behind them: :mod:`.context` (per-process state, :func:`opd_stats`), :mod:`.scoring` (the
teacher request and its endpoint), :mod:`.switching` (switched teachers), :mod:`.router`,
:mod:`.teachers`, :mod:`.pool`, :mod:`.same_origin`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from ..json_client import JSONRequestError
from ..plugins import roles
from ..plugins.settings import SettingsError
from .context import (  # noqa: F401  (coefs_differ, needs_metadata, topk_mode, opd_stats, reset_state: declared and public paths)
    FORWARD_METADATA_PATCH, LOSS_BATCH_PATCH, META_LOG_PROBS, META_TEACHER, META_TOPK, TRAIN_META_COEF,
    TRAIN_META_TOPK, OPDContext, _student_info, _teachers, coefs_differ, get_context, logger, needs_metadata,
    opd_stats, reset_state, rule_args, switched_teachers, topk_mode,
)
from .scoring import _score, _task_reward, is_switched, meta_info, response_teacher_log_probs, score_switched

# sample.metadata key: why the sample's teacher could not score it (the sample is then FAILED, removed)
META_FAILURE = "opd_failure"
# sample.metadata key: the switched teacher the sample waits for (scored with its rollout, then removed)
META_PENDING = "opd_pending_teacher"


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
    problems = []
    # slime gives the critic its own args with use_opd switched off (_apply_megatron_role_overrides): the
    # critic fits values and never sees teachers, so the pass-through rule is the actor's and the driver's
    critic = roles.train_role() == "critic"
    if settings["ascend_opd_mode"] == "topk" and not critic:
        _validate_topk(args)
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
    if roles.train_role() is None:  # the driver and the rollout manager; train actors never ask a teacher
        _validate_compat(args, settings, teachers)
        _validate_shared_engine(args, settings, teachers)


def _validate_shared_engine(args: Any, settings: Mapping[str, Any], teachers: Sequence[Any]) -> None:
    """The teachers the pool switches on ``ascend_opd_switch_engine_urls`` are one architecture
    (:mod:`.shared_engine`); refused in one line otherwise."""
    from .shared_engine import architecture_mismatch

    if not settings["ascend_opd_switch_engine_urls"]:
        return
    transport = settings["ascend_opd_switch_transport"]
    if transport != "disk" and settings["ascend_opd_stage_dir"]:
        raise SettingsError(
            "opd: ascend_opd_stage_dir is the disk transport's copy of each teacher; with "
            f"ascend_opd_switch_transport: {transport} the next teacher is staged in host memory. Fix: unset "
            "ascend_opd_stage_dir, or switch over disk")
    switched = switched_teachers(args, teachers)
    why = architecture_mismatch([(t.name, t.checkpoint_dir) for t in switched]) if len(switched) > 1 else None
    if why:
        raise SettingsError(
            f"opd: the teachers switched on {list(settings['ascend_opd_switch_engine_urls'])} must be one "
            f"architecture (the engine loads each into the same model), but {why}. Fix: give that teacher an "
            "engine of its own (its url in ascend_opd_teachers) or switch only teachers of one architecture"
        )


def _validate_compat(args: Any, settings: Mapping[str, Any], teachers: Sequence[Any]) -> None:
    """Each teacher's vocabulary, special tokens, tokenizer and chat template against the student's
    (``--hf-checkpoint``; :mod:`.compat`): a mismatch in strict mode is a SettingsError (one line)."""
    from .compat import check_teachers
    from .teachers import TeacherMismatchError

    try:
        check_teachers(teachers, getattr(args, "hf_checkpoint", None), mode=settings["ascend_opd_compat_check"],
                       student_vocab_size=_student_info(args).get("student_vocab_size"), log=logger)
    except TeacherMismatchError as e:
        raise SettingsError(str(e)) from None

_LOSS_DISPATCHER = "slime_ascend.hooks.loss_function"


def _validate_topk(args: Any) -> None:
    """topk mode: the top-k term is added by slime_ascend's loss dispatcher, so slime must call it."""
    if getattr(args, "loss_type", "custom_loss") != "custom_loss":
        raise SettingsError(
            f"ascend_opd_mode='topk' adds the top-k loss through slime's custom loss, but loss_type is "
            f"{args.loss_type!r}. Fix: set loss_type: custom_loss (as `slime-ascend config opd` writes) and drop "
            "--loss-type from the command line, or use ascend_opd_mode: sampled"
        )
    path = getattr(args, "custom_loss_function_path", _LOSS_DISPATCHER)
    if path != _LOSS_DISPATCHER:
        raise SettingsError(
            f"ascend_opd_mode='topk' adds the top-k loss in {_LOSS_DISPATCHER}, but custom_loss_function_path is "
            f"{path!r}. Fix: set custom_loss_function_path: {_LOSS_DISPATCHER} (as `slime-ascend config opd` "
            "writes; another plugin's loss is run by it), or use ascend_opd_mode: sampled"
        )


async def slime_rule_reward(args: Any, sample: Any, **kwargs: Any) -> Any:
    """Task reward from slime's own rule-based reward models (``--rm-type``), for ``ascend_opd_task_rm_path``.

    With the ``opd`` plugin ``--custom-rm-path`` is our dispatcher, so slime's ``async_rm`` would call it
    back instead of applying ``--rm-type``; this calls ``async_rm`` with the custom path cleared on a
    shallow copy of ``args`` (made once per ``args``).
    """
    from slime.rollout.rm_hub import async_rm

    base = rule_args(args)
    if not (getattr(base, "rm_type", None) or "").strip() and not (
        isinstance(getattr(sample, "metadata", None), dict) and sample.metadata.get("rm_type")
    ):
        raise ValueError(
            "ascend_opd_task_rm_path is slime_rule_reward but --rm-type is not set. Fix: pass --rm-type "
            "(e.g. math, deepscaler, dapo), or unset ascend_opd_task_rm_path for pure distillation (reward 0.0)"
        )
    return await async_rm(base, sample, **kwargs)


async def _reward_one(args: Any, ctx: OPDContext, sample: Any, **kwargs: Any) -> Any:
    if getattr(sample, "metadata", None) is None:
        sample.metadata = {}
    spec = ctx.router.route(sample.metadata, sample_id=getattr(sample, "index", None))
    if is_switched(args, spec):  # scored with its rollout, grouped by teacher (:func:`_score_pending`)
        reward = await _task_reward(args, ctx, sample, **kwargs)
        sample.metadata[META_TEACHER] = spec.name
        sample.metadata[META_PENDING] = spec.name
        ctx.note_deferred(spec.name)
        return reward
    scored, reward = await asyncio.gather(_score(args, ctx, spec, sample), _task_reward(args, ctx, sample, **kwargs),
                                          return_exceptions=True)
    if isinstance(reward, BaseException):
        raise reward
    sample.metadata[META_TEACHER] = spec.name
    _apply_scored(ctx, spec.name, sample, scored)
    return reward

def _apply_scored(ctx: OPDContext, teacher: str, sample: Any, scored: Any) -> None:
    """Put the teacher's reply for ``sample`` into its metadata (log-probs; top-k in topk mode); a teacher that
    did not answer (after its retries) makes the sample an environment failure; other errors are raised."""
    if isinstance(scored, JSONRequestError):
        _teacher_failed(sample, teacher, scored)
        return
    if isinstance(scored, BaseException):
        raise scored
    sample.metadata[META_LOG_PROBS] = response_teacher_log_probs(scored, sample.response_length, teacher)
    if ctx.settings["ascend_opd_mode"] == "topk":
        from ..algorithms.opd import topk_payload_from_sglang

        top = meta_info(scored, "input_top_logprobs", teacher, "in ascend_opd_mode topk the endpoint must be an "
                        "SGLang /generate that honours top_logprobs_num with return_logprob")
        sample.metadata[META_TOPK] = topk_payload_from_sglang(top, sample.response_length, ctx.settings["ascend_opd_topk"])

def _score_pending(args: Any, ctx: OPDContext, samples: Sequence[Any]) -> None:
    """Score the samples of this rollout that wait for a switched teacher, grouped by teacher with the resident
    one first (at most one switch per teacher the rollout needs). A sample already removed (zero loss mask)
    is not scored."""
    prefer = ctx.take_hint()
    specs = {t.name: t for t in ctx.teachers}
    items = []
    for sample in samples:
        md = getattr(sample, "metadata", None)
        name = md.pop(META_PENDING, None) if isinstance(md, dict) else None
        if name is not None and not getattr(sample, "remove_sample", False):
            items.append((specs[name], sample))
    if not items:
        return
    results = ctx.run_scoring(score_switched(args, ctx, items, prefer))
    for (spec, sample), scored in zip(items, results, strict=True):
        _apply_scored(ctx, spec.name, sample, scored)

def _teacher_failed(sample: Any, teacher: str, error: Exception) -> None:
    """A teacher that could not score ``sample`` (unreachable, timed out, HTTP error after the retries) makes it an
    environment failure, not a zero reward: status FAILED and ``remove_sample`` (slime trains nothing on it; the
    dispatcher's group normalisation leaves it out), the reason in ``metadata["opd_failure"]``. Its task reward is
    kept as the (logged) placeholder."""
    status = getattr(type(sample), "Status", None)
    if status is not None and hasattr(status, "FAILED"):
        sample.status = status.FAILED
    sample.remove_sample = True
    reason = f"teacher {teacher!r} did not score it: {' '.join(str(error).split())[:300]}"
    sample.metadata[META_FAILURE] = reason
    logger.warning("opd: sample index=%s failed as an environment failure (%s)", getattr(sample, "index", None), reason)


async def teacher_reward(args: Any, sample: Any, **kwargs: Any) -> Any:
    """``reward_model`` contribution: route and score at the teacher; returns the task reward.

    Accepts one sample or, for slime's batched / group RM calls, a list (returns a list).
    """
    ctx = get_context(args, rollout_side=True)
    if isinstance(sample, list):
        return list(await asyncio.gather(*(_reward_one(args, ctx, s, **kwargs) for s in sample)))
    return await _reward_one(args, ctx, sample, **kwargs)

def fill_teacher_log_probs(args: Any, samples: list[Any], raw_rewards: list[Any], rewards: list[Any]):
    """``reward_post_process`` contribution (order 300); rewards pass through unchanged."""
    import torch

    ctx = get_context(args, rollout_side=True)
    _score_pending(args, ctx, samples)
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
        if ctx.settings["ascend_opd_mode"] == "topk":
            tm[TRAIN_META_TOPK] = _topk_payload(ctx, sample, md.pop(META_TOPK, None) or tm.get(TRAIN_META_TOPK), i)
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

    metrics = rollout_step_metrics(ctx, counts, per_teacher_kl)
    # samples whose teacher did not answer: environment failures (FAILED, removed), not zero rewards
    metrics["rollout/opd_failed_samples"] = sum(
        1 for s in samples if isinstance(getattr(s, "metadata", None), dict) and s.metadata.get(META_FAILURE))
    report(args, logger, "opd", metrics)
    if first and ctx.settings["ascend_opd_same_origin_check"]:
        _same_origin_once(ctx, per_teacher_kl, kl_tokens)
    return raw_rewards, rewards

def _topk_payload(ctx: OPDContext, sample: Any, payload: Any, i: int) -> dict[str, Any]:
    """The sample's teacher top-k payload, checked against its response length; a dropped sample without
    one gets an all-padding payload (ids -1: no loss), keeping every sample's metadata alike."""
    from ..algorithms.opd import pack_topk_payload, unpack_topk_payload

    k = ctx.settings["ascend_opd_topk"]
    if payload is None:
        if not getattr(sample, "remove_sample", False):
            raise ValueError(
                f"sample {getattr(sample, 'index', i)!r} has no teacher top-k payload in topk mode: it was not "
                "scored by the opd reward model with top_logprobs_num (is --custom-rm-path the slime_ascend dispatcher?)"
            )
        import torch

        n = sample.response_length
        return pack_topk_payload(torch.full((n, k), -1, dtype=torch.int32), torch.full((n, k), float("-inf")))
    ids, _ = unpack_topk_payload(payload)
    if ids.shape[0] != sample.response_length:
        raise ValueError(f"sample {getattr(sample, 'index', i)!r}: top-k payload has {ids.shape[0]} rows for "
                         f"response_length {sample.response_length}")
    return payload


_POOL_KEYS = ("switches", "prefetch_started", "prefetch_hits", "prefetch_late", "prefetch_misses", "cold_loads",
              "stage_retries", "stage_failures", "failed_teachers", "stall_s", "last_stall_s", "stage_s",
              "read_bytes", "peak_host_bytes")
_POOL_SECONDS = ("stall_s", "last_stall_s", "stage_s")

def rollout_step_metrics(ctx: OPDContext, counts: Mapping[str, int], kl: Mapping[str, float]) -> dict[str, float]:
    """This rollout's routing and teacher-pool figures, as ``rollout/*`` keys for slime's rollout metric path:
    ``rollout/opd_samples/<teacher>`` (samples routed to it; every configured teacher),
    ``rollout/opd_kl_k3/<teacher>`` (mean per-token KL(student||teacher), k3) and, with a switched-teacher
    pool, its counters since start as ``rollout/opd_pool/<counter>`` (switches, prefetch started / hits /
    late / misses, cold loads, stage retries / failures, failed teachers, the seconds the switches stalled scoring
    in all and in the last one, the seconds spent staging, the bytes read from the checkpoints to stage and the
    most bytes of teacher weights the pool held in host memory at once)."""
    out: dict[str, float] = {f"rollout/opd_samples/{n}": int(counts.get(n, 0)) for n in ctx.coefs}
    out.update({f"rollout/opd_kl_k3/{n}": float(v) for n, v in kl.items()})
    if ctx.switcher is not None:
        pool = ctx.switcher.metrics()
        out.update({f"rollout/opd_pool/{k}": (float(pool[k]) if k in _POOL_SECONDS else int(pool[k]))
                    for k in _POOL_KEYS if k in pool})
    return out

def _same_origin_once(ctx: OPDContext, kl: Mapping[str, float], kl_tokens: Mapping[str, int]) -> None:
    from .same_origin import report_from_kls

    if not kl_tokens:
        logger.warning("opd same-origin check skipped: samples carry no rollout_log_probs to compare with")
        return
    s = ctx.settings
    report = report_from_kls(
        kl,
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

def per_sample_coefs(ctx: OPDContext, rollout_data: Mapping[str, Any], n: int) -> list[float]:
    """Each local sample's teacher coefficient: from the forwarded ``metadata`` when present, else
    the single coefficient all teachers share (else an error naming the fix)."""
    metadata = rollout_data.get("metadata")
    if metadata is not None:
        if len(metadata) != n:
            raise ValueError(f"rollout_data['metadata'] has {len(metadata)} entries for {n} samples")
        if all(isinstance(md, Mapping) and TRAIN_META_COEF in md for md in metadata):
            return [float(md[TRAIN_META_COEF]) for md in metadata]
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
    # topk mode: the teacher signal is the loss term (opd_topk_loss); the advantage keeps the task term
    signal_coefs = [0.0] * len(coefs) if ctx.settings["ascend_opd_mode"] == "topk" else coefs
    new_adv, reverse_kls = opd_advantages_per_sample(
        teacher,
        student,
        signal_coefs,
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


def opd_topk_loss(args: Any, batch: Mapping[str, Any], logits: Any, sum_of_sample_mean: Any):
    """``loss_term`` contribution: in topk mode, ``sum_i coef_i * (top-k reverse KL of sample i)`` reduced with
    slime's ``sum_of_sample_mean`` (None in sampled mode and in critic passes).

    The student's log-probs at the teacher's ids come from this micro-batch's logits (slime's
    ``get_responses``: response rows, CP-local, divided by ``--rollout-temperature`` as slime's own
    log-probs), as ``logit[id] - logsumexp`` over the full vocabulary (all-reduced over the tensor-parallel
    group when the logits are vocabulary-parallel). The payload rows are sliced to this CP rank's
    response pieces: zig-zag, or under ``--allgather-cp`` the rank's contiguous range, whose per-token KL is then
    moved to the zig-zag pieces ``sum_of_sample_mean`` reduces (as slime moves its log-probs). Metrics:
    ``opd_topk_kl`` (the uncoefficiented KL) and ``opd_topk_loss`` (the term).
    """
    import torch

    from ..algorithms.cp import allgather_response_range, allgather_to_zigzag, cp_slice
    from ..algorithms.opd import topk_reverse_kl_gathered, topk_student_log_probs, unpack_topk_payload

    if getattr(args, "loss_type", None) == "value_loss":  # a critic pass routed to the loss dispatcher
        return None
    ctx = get_context(args)
    if ctx.settings["ascend_opd_mode"] != "topk":
        return None
    metadata = batch.get("metadata")
    if metadata is None:
        raise RuntimeError(
            "opd topk loss: the loss batch has no per-sample 'metadata' with the teacher top-k payload: the "
            f"runtime patches {FORWARD_METADATA_PATCH!r} (RolloutManager) and {LOSS_BATCH_PATCH!r} (train actors) "
            "are not active. Fix: export SLIME_ASCEND_PLUGINS with opd to the driver and to `ray start`, so "
            "slime-ascend installs them as those processes start"
        )
    from megatron.core import mpu
    from slime.backends.megatron_utils.loss import get_responses

    cp_rank, cp_size = mpu.get_context_parallel_rank(), mpu.get_context_parallel_world_size()
    tp_size = mpu.get_tensor_model_parallel_world_size()
    reduce_sum = reduce_max = None
    vocab_start = 0
    if tp_size > 1:  # vocabulary-parallel logits: this rank holds [V / tp] columns
        import torch.distributed as dist
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        group = mpu.get_tensor_model_parallel_group()

        def reduce_max(x):
            x = x.clone()
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
            return x

        reduce_sum = reduce_from_tensor_model_parallel_region
        vocab_start = mpu.get_tensor_model_parallel_rank() * logits.shape[-1]
    vocab = logits.shape[-1] * tp_size
    total_lengths, response_lengths = batch["total_lengths"], batch["response_lengths"]
    chunks = get_responses(logits, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=total_lengths,
                           response_lengths=response_lengths)
    allgather = cp_size > 1 and bool(getattr(args, "allgather_cp", False))
    kls, weighted, ranges, seq_start = [], [], [], 0
    for i, (chunk, _) in enumerate(chunks):
        md = metadata[i]
        payload = md.get(TRAIN_META_TOPK) if isinstance(md, Mapping) else None
        if payload is None:
            raise RuntimeError(f"opd topk loss: sample {i} of the micro-batch has no {TRAIN_META_TOPK!r} in its "
                               "forwarded metadata (did the opd reward post-process run in topk mode?)")
        ids, t_lps = unpack_topk_payload(payload, device=chunk.device)
        total, resp = int(total_lengths[i]), int(response_lengths[i])
        if ids.shape[0] != resp:
            raise RuntimeError(f"opd topk loss: sample {i} has {ids.shape[0]} top-k rows for response length {resp}")
        mask = batch["loss_masks"][i].to(chunk.device)
        if allgather:  # the rank's logits cover one contiguous range of the response (slime's get_responses)
            lo, hi = allgather_response_range(cp_rank, logits.shape[-2], seq_start, total, resp)
            ids, t_lps, mask = ids[lo:hi], t_lps[lo:hi], mask[lo:hi]
            ranges.append((lo, hi))
            seq_start += total
        elif cp_size > 1:
            ids, t_lps, mask = (cp_slice(x, cp_rank, cp_size, total, resp) for x in (ids, t_lps, mask))
        s_lps = topk_student_log_probs(chunk, ids, vocab_start=vocab_start, reduce_sum=reduce_sum,
                                       reduce_max=reduce_max)
        per_token, _ = topk_reverse_kl_gathered(s_lps, ids, t_lps, mask, vocab_size=vocab)
        kls.append(per_token)
        weighted.append(per_token * float(md[TRAIN_META_COEF]))
    if not kls:
        zero = logits.sum() * 0.0
        return zero, {"opd_topk_kl": zero.detach(), "opd_topk_loss": zero.detach()}
    if allgather:  # to the zig-zag pieces of slime's sum_of_sample_mean, with one autograd all-reduce
        import torch.distributed.nn.functional as dist_nn

        group = mpu.get_context_parallel_group()
        both = allgather_to_zigzag([torch.stack([w, k.detach()], -1) for w, k in zip(weighted, kls, strict=True)],
                                   ranges, total_lengths, response_lengths, cp_rank, cp_size,
                                   lambda x: dist_nn.all_reduce(x, group=group))
        weighted, kls = [x[:, 0] for x in both], [x[:, 1] for x in both]
    term = sum_of_sample_mean(torch.cat(weighted, dim=0))
    kl = sum_of_sample_mean(torch.cat(kls, dim=0).detach())
    return term, {"opd_topk_kl": kl.detach().clone(), "opd_topk_loss": term.detach().clone()}

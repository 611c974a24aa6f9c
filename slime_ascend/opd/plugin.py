"""The ``opd`` plugin: multi-teacher on-policy distillation (MOPD) on stock slime.

Each sample is hard-routed by its domain label (``sample.metadata[ascend_opd_domain_key]``) to one
teacher of the ``ascend_opd_teachers`` section; only that teacher scores it. The pieces:

* ``reward_model`` (rollout manager, async): routes the sample, scores ``sample.tokens`` at its
  teacher (``POST /generate``, ``max_new_tokens=0``, ``return_logprob``, ``logprob_start_len=0``)
  and returns the task reward (``ascend_opd_task_rm_path``; 0.0 when unset, i.e. pure
  distillation; ``slime_ascend.opd.hooks.slime_rule_reward`` applies slime's own ``--rm-type``),
  so ``raw_reward`` stays a task reward rather than slime's teacher JSON.
* ``reward_post_process`` (order 300): fills ``sample.teacher_log_probs`` (response-aligned, as
  slime's ``post_process_rewards``) and ``sample.train_metadata["opd_teacher"/"opd_coef"]``;
  logs routing counts; runs the same-origin KL check once, before the first training step.
* ``advantage`` (order 500, train actor): ``A = task_weight * A_task + coef_t * (logp_T - logp_S)``
  with the routed teacher's coefficient. When no earlier plugin computed ``A_task``, slime's own
  estimator is run first. slime's own OPD term is kept off (``opd_kl_coef: 0``) while
  ``use_opd: true`` keeps slime forwarding and CP-slicing ``teacher_log_probs`` and recomputing the
  student log-probs before advantages. Adds ``opd_coef`` and ``opd_share/<teacher>`` per sample,
  which slime's train-side rollout logger reports as ``rollout/opd_coef`` and
  ``rollout/opd_share/<teacher>``; the rollout manager logs routing and teacher-pool counters.

* start-up compatibility (``validate``, in the driver and the rollout manager): each teacher's vocab
  size, special token ids, tokenizer and chat template against the student's ``--hf-checkpoint``
  (:mod:`slime_ascend.opd.compat`); a mismatch refuses to start, naming the teacher and the field,
  unless ``ascend_opd_compat_check`` (or the teacher's ``compat_check``) says warn / off.

* ``loss_term`` (train actor, ``ascend_opd_mode: topk`` only): the MOPD top-k loss. The teacher request
  adds ``top_logprobs_num = ascend_opd_topk``; each sample's teacher top-k ids and log-probs
  (``meta_info.input_top_logprobs``, response-aligned, packed int32/fp32) ride in
  ``Sample.train_metadata["opd_topk"]``; the loss adds ``coef_t * sum_v [P_S log(P_S/P_T) - P_S + P_T]``
  over the teacher's top-k, reduced with slime's ``sum_of_sample_mean``, to the loss slot's loss (slime's
  ``policy_loss_function`` when no plugin provides one) and logs ``opd_topk_kl``. The advantage then
  keeps the task term only (``A = ascend_opd_task_weight * A_task``).

Per-sample facts reach the trainer through ``train_metadata``: where teachers' coefficients differ or in
topk mode, the runtime installs ``rollout.forward_metadata`` in the RolloutManager and
``train.rollout_log_metadata`` in each train actor; in topk mode also ``train.loss_batch_metadata``, which
puts each micro-batch's metadata into slime's loss batch. Nothing heavy is imported here.
"""

from __future__ import annotations

from typing import Any

from ..plugins.base import Contribution, PatchUse, Plugin
from ..plugins.settings import Setting

_H = "slime_ascend.opd.hooks."


def _check_teachers(value: Any) -> str | None:
    if value in ({}, []):
        return None  # empty = not configured yet; validate() asks for it with the fix
    from .teachers import TeacherConfigError, parse_teachers

    try:
        parse_teachers(value)
    except TeacherConfigError as e:
        return str(e)
    return None


SETTINGS = (
    Setting("ascend_opd_teachers", dict, [],
            "teachers: list of {name, checkpoint_dir, domains, coef?, tokenizer_revision?, vocab_size?, url?, "
            "compat_check?}",
            check=_check_teachers),
    Setting("ascend_opd_domain_key", str, "domain", "sample.metadata key holding the domain label used for routing"),
    Setting("ascend_opd_default_teacher", str, None,
            "teacher for samples whose domain has no route (unset: a missing route is an error)", optional=True),
    Setting("ascend_opd_coef", float, 1.0, "OPD coefficient of teachers without their own 'coef'", minimum=0.0),
    Setting("ascend_opd_mode", str, "sampled",
            "signal: 'sampled' (A += coef_t * (logp_T - logp_S) on the sampled token); 'topk' (MOPD: the loss "
            "adds coef_t * the top-k corrected reverse KL over the teacher's top-k tokens; the advantage keeps "
            "the task term only)", choices=("sampled", "topk")),
    Setting("ascend_opd_topk", int, 32, "k of the teacher top-k request (top_logprobs_num) in topk mode",
            minimum=1, maximum=1024),
    Setting("ascend_opd_task_weight", float, 1.0, "weight alpha of the task advantage: A = alpha*A_task + coef*OPD"),
    Setting("ascend_opd_clip", float, None, "clip the per-token OPD term to [-clip, clip] (unset: no clip)",
            optional=True, minimum=0.0),
    Setting("ascend_opd_task_rm_path", str, None,
            "dotted path of the task reward function fn(args, sample, **kw) (sync or async); unset: reward 0.0",
            optional=True),
    Setting("ascend_opd_request_timeout_s", float, 600.0, "timeout of one teacher scoring request", minimum=1.0),
    Setting("ascend_opd_request_retries", int, 2, "retries of a failed teacher scoring request", minimum=0),
    Setting("ascend_opd_switch_engine_urls", list, [],
            "engine URL(s) that host the *switched* teacher (teachers without url and not in --sglang-config); "
            "switched as ascend_opd_switch_transport says", check=lambda v: None if all(
                isinstance(u, str) and u.startswith(("http://", "https://")) for u in v) else "URLs must be http(s)"),
    Setting("ascend_opd_switch_transport", str, "disk",
            "how a switched teacher reaches its engine: 'disk' (/update_weights_from_disk of the checkpoint, or of "
            "its copy in ascend_opd_stage_dir), 'distributed' (staged in host memory while the current teacher "
            "scores, pushed over the engine's weight-update group: /init_weights_update_group + "
            "/update_weights_from_distributed, slime's own sync path) or 'tensor' (staged in shared memory, handed "
            "to the engine by /update_weights_from_tensor, slime's colocated path: the engines on the pool's host)",
            choices=("disk", "distributed", "tensor")),
    Setting("ascend_opd_switch_backend", str, "gloo",
            "distributed transport: the group's backend; gloo broadcasts from host memory, nccl/hccl need the pool's "
            "process on the device", choices=("gloo", "nccl", "hccl")),
    Setting("ascend_opd_switch_master_address", str, None,
            "distributed transport: the address the engines reach the pool's process at (unset: this node's IP "
            "as Ray reports it, else 127.0.0.1)", optional=True),
    Setting("ascend_opd_switch_bucket_mb", int, 256,
            "distributed transport: MiB of tensors per /update_weights_from_distributed call", minimum=1),
    Setting("ascend_opd_stage_dir", str, None, "disk transport: local stage directory (NVMe cache tier) for "
            "switched teachers", optional=True),
    Setting("ascend_opd_prefetch", bool, True, "stage the next switched teacher in the background"),
    Setting("ascend_opd_pool_actor", str, None,
            "name of a Ray actor holding the TeacherPool, shared by several rollout workers (unset: in-process)",
            optional=True),
    Setting("ascend_opd_compat_check", str, "strict",
            "teacher/student compatibility at start (vocab_size, tokenizer length, bos/eos/pad/unk and special "
            "token ids, tokenizer, chat template; from each checkpoint_dir, else asked of the teacher's url): "
            "'strict' (a mismatch refuses to start), 'warn' (log it and start), 'off' (skip); a teacher's own "
            "compat_check overrides it", choices=("strict", "warn", "off")),
    Setting("ascend_opd_same_origin_check", bool, True,
            "before the first train step, compare each teacher's initial per-token KL to the student"),
    Setting("ascend_opd_same_origin_ratio", float, 3.0,
            "flag a teacher whose KL exceeds this multiple of the other teachers' median", minimum=1.0001),
    Setting("ascend_opd_same_origin_max_kl", float, None, "flag a teacher whose KL exceeds this (unset: off)",
            optional=True, minimum=0.0),
    Setting("ascend_opd_same_origin_action", str, "warn", "on a flagged teacher: 'warn' (log) or 'error' (stop)",
            choices=("warn", "error")),
)

PLUGIN = Plugin(
    name="opd",
    description="multi-teacher on-policy distillation: domain routing, per-teacher coefficients, teacher switching",
    settings=SETTINGS,
    contributions=(
        Contribution("reward_model", _H + "teacher_reward", note="route + score at the teacher; returns task reward"),
        Contribution("reward_post_process", _H + "fill_teacher_log_probs", order=300,
                     note="teacher_log_probs, routed coef, same-origin check"),
        Contribution("advantage", _H + "opd_advantage", order=500,
                     note="A += coef_t * (logp_T - logp_S) (sampled); A = alpha * A_task (topk)"),
        Contribution("loss_term", _H + "opd_topk_loss", order=500,
                     note="topk mode: + coef_t * top-k reverse KL (sampled mode: nothing)"),
    ),
    patches=(
        PatchUse("rollout.forward_metadata", "rollout", when=_H + "needs_metadata"),
        PatchUse("train.rollout_log_metadata", "train", when=_H + "needs_metadata"),
        PatchUse("train.loss_batch_metadata", "train", when=_H + "topk_mode"),
    ),
    slime_args=(("use_opd", True), ("opd_type", "sglang"), ("opd_kl_coef", 0.0)),
    validate=_H + "validate",
)

"""On-policy distillation (OPD / MOPD) signals: pure tensor functions.

Two training signals are provided, both for a routed teacher ``T`` (one teacher per sample, never
an average of teachers):

* **Sampled-token advantage** (slime ``apply_opd_kl_to_advantages``; MiMo-V2-Flash Eq. 7-8)::

      A_t = alpha * A_task_t + coef * sg[ log pi_T(y_t) - log pi_S(y_t) ]

  ``coef`` may differ per sample (per-teacher coefficients). ``sg`` = stop-gradient: the result
  is always detached. This equals slime's ``A_t - opd_kl_coef * (logp_S - logp_T)``.

* **Top-k generalised reverse KL** (MOPD top-k form) on the teacher's top-k set ``I_T``::

      l_t = sum_{v in I_T(t)} [ P_S(v) * (log P_S(v) - log P_T(v)) - P_S(v) + P_T(v) ]

  ``log P_S`` is an fp32 log-softmax over the *full* student vocabulary, gathered at ``I_T``; it
  is **not** renormalised over the top-k set. The ``- P_S + P_T`` correction makes this the
  unnormalised KL: d l_t / d P_S(v) = log P_S(v) - log P_T(v), so the kept support is stationary
  exactly at ``P_S = P_T``. An entry with ``P_S(v) = 0`` (a ``-inf`` student logit) contributes
  ``P_T(v)`` (``0 * log 0 = 0``), with a zero gradient, masked or not. The opd plugin reduces ``l_t`` to
  the sequence loss with slime's ``sum_of_sample_mean``.

Payload helpers move only the teacher's top-k ids and log-probs between processes, never
full-vocabulary logits. Nothing here imports slime, ray or megatron; every function runs on the
device of its inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "opd_advantages",
    "opd_advantages_per_sample",
    "topk_reverse_kl",
    "topk_reverse_kl_gathered",
    "topk_student_log_probs",
    "pack_topk_payload",
    "unpack_topk_payload",
    "topk_payload_from_sglang",
    "MAX_TOPK",
]

#: Largest k accepted in a payload; a larger "top-k" is almost surely full-vocabulary logits.
MAX_TOPK = 1024


# --------------------------------------------------------------------------------------------
# Sampled-token advantage
# --------------------------------------------------------------------------------------------
def opd_advantages(
    teacher_log_probs: torch.Tensor,
    student_log_probs: torch.Tensor,
    coef: float | torch.Tensor = 1.0,
    task_advantages: torch.Tensor | None = None,
    task_weight: float = 1.0,
    clip: float | None = None,
) -> torch.Tensor:
    """``task_weight * A_task + coef * sg[logp_T - logp_S]`` elementwise (detached).

    Args:
        teacher_log_probs: log pi_T of the sampled tokens, any shape.
        student_log_probs: log pi_S of the same tokens, same shape.
        coef: scalar, or a tensor broadcastable to the shape (e.g. ``[B, 1]`` per sample).
        task_advantages: optional task advantage of the same shape.
        task_weight: alpha, the weight of ``task_advantages``.
        clip: if given, the OPD term is clipped to ``[-clip, clip]`` before adding.
    """
    if not isinstance(teacher_log_probs, torch.Tensor) or not isinstance(student_log_probs, torch.Tensor):
        raise TypeError("teacher_log_probs and student_log_probs must be torch.Tensor")
    if teacher_log_probs.shape != student_log_probs.shape:
        raise ValueError(
            f"teacher_log_probs shape {tuple(teacher_log_probs.shape)} != student_log_probs shape "
            f"{tuple(student_log_probs.shape)}; both must cover the same response tokens"
        )
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be > 0 or None, got {clip}")
    t = teacher_log_probs.detach().to(device=student_log_probs.device, dtype=torch.float32)
    s = student_log_probs.detach().float()
    if isinstance(coef, torch.Tensor):
        coef = coef.detach().to(device=s.device, dtype=torch.float32)
    signal = coef * (t - s)
    if signal.shape != s.shape:
        raise ValueError(f"coef of shape {tuple(coef.shape)} does not broadcast to {tuple(s.shape)}")
    if clip is not None:
        signal = signal.clamp(-clip, clip)
    if task_advantages is None:
        return signal
    if task_advantages.shape != s.shape:
        raise ValueError(
            f"task_advantages shape {tuple(task_advantages.shape)} != log-prob shape {tuple(s.shape)}"
        )
    return task_weight * task_advantages.detach().float() + signal


def opd_advantages_per_sample(
    teacher_log_probs: Sequence[torch.Tensor],
    student_log_probs: Sequence[torch.Tensor],
    coefs: float | Sequence[float] = 1.0,
    task_advantages: Sequence[torch.Tensor] | None = None,
    task_weight: float = 1.0,
    clip: float | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-sample lists (slime's ``rollout_data`` layout) -> (advantages, reverse_kls).

    ``coefs`` is one float or one float per sample (e.g. the routed teacher's coefficient).
    ``reverse_kls[i] = logp_S - logp_T`` (detached), what slime logs as ``opd_reverse_kl``.
    With ``task_advantages`` given, ``advantages[i] = task_weight * task_advantages[i]
    + coefs[i] * (logp_T - logp_S)``, i.e. slime's ``A - coef * reverse_kl`` for ``task_weight=1``.
    """
    n = len(student_log_probs)
    if len(teacher_log_probs) != n:
        raise ValueError(f"got {len(teacher_log_probs)} teacher_log_probs for {n} samples")
    if isinstance(coefs, (int, float)):
        coef_list = [float(coefs)] * n
    else:
        coef_list = [float(c) for c in coefs]
        if len(coef_list) != n:
            raise ValueError(f"coefs has {len(coef_list)} entries for {n} samples; give one per sample")
    if task_advantages is not None and len(task_advantages) != n:
        raise ValueError(f"got {len(task_advantages)} task_advantages for {n} samples")
    advantages: list[torch.Tensor] = []
    reverse_kls: list[torch.Tensor] = []
    for i in range(n):
        s = student_log_probs[i].detach().float()
        t = teacher_log_probs[i].detach().to(device=s.device, dtype=torch.float32)
        if t.shape != s.shape:
            raise ValueError(
                f"sample {i}: teacher_log_probs length {tuple(t.shape)} != student_log_probs "
                f"{tuple(s.shape)} (teacher log-probs must be cut to the response length)"
            )
        reverse_kls.append(s - t)
        task = None if task_advantages is None else task_advantages[i].to(s.device)
        advantages.append(opd_advantages(t, s, coef_list[i], task, task_weight, clip))
    return advantages, reverse_kls


# --------------------------------------------------------------------------------------------
# Top-k generalised reverse KL
# --------------------------------------------------------------------------------------------
def topk_reverse_kl(
    student: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    *,
    student_is_log_probs: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token MOPD top-k loss ``sum_{v in I_T} [P_S log(P_S/P_T) - P_S + P_T]``.

    Args:
        student: student logits ``[..., V]`` (log-softmaxed here in fp32 over the full
            vocabulary) or, with ``student_is_log_probs=True``, full-vocabulary log-probs.
        teacher_topk_ids: ``[..., k]`` integer token ids of the teacher's top-k; ``-1`` = padding.
        teacher_topk_log_probs: ``[..., k]`` teacher log-probs at those ids (full-vocabulary
            normalised). Entries at padding, or non-finite entries, are ignored.
        loss_mask: ``[...]`` 0/1 mask of tokens that count (default: all).
        student_is_log_probs: set when ``student`` already holds log-probs.

    Returns:
        ``(per_token_loss [...], metrics)``; masked tokens have loss 0. ``metrics`` holds
        detached 0-dim tensors (no host sync): ``topk_kl`` (masked token mean of the loss),
        ``student_topk_mass`` and ``teacher_topk_mass`` (masked means of sum P over I_T),
        ``valid_topk`` (mean number of kept entries per masked token).
    """
    if teacher_topk_ids.shape != teacher_topk_log_probs.shape:
        raise ValueError(
            f"teacher_topk_ids shape {tuple(teacher_topk_ids.shape)} != teacher_topk_log_probs shape "
            f"{tuple(teacher_topk_log_probs.shape)}"
        )
    if teacher_topk_ids.dtype.is_floating_point or teacher_topk_ids.dtype == torch.bool:
        raise TypeError(f"teacher_topk_ids must be an integer tensor, got {teacher_topk_ids.dtype}")
    if student.shape[:-1] != teacher_topk_ids.shape[:-1]:
        raise ValueError(
            f"student leading shape {tuple(student.shape[:-1])} != teacher top-k leading shape "
            f"{tuple(teacher_topk_ids.shape[:-1])}"
        )
    vocab = student.shape[-1]
    ids = teacher_topk_ids.to(student.device).long()
    student_lp_full = student.float() if student_is_log_probs else torch.log_softmax(student.float(), dim=-1)
    # ids beyond the vocab would silently gather garbage on some backends: clamp then invalidate
    in_vocab = (ids >= 0) & (ids < vocab)
    safe_ids = torch.where(in_vocab, ids, torch.zeros_like(ids))
    s_lp = torch.gather(student_lp_full, -1, safe_ids)  # no renormalisation over top-k
    return _topk_terms(s_lp, in_vocab, teacher_topk_log_probs, loss_mask)


def topk_reverse_kl_gathered(
    student_topk_log_probs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    *,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`topk_reverse_kl` from the student's full-vocabulary log-probs already gathered at the
    teacher's ids (``[..., k]``, e.g. from :func:`topk_student_log_probs`); same loss and metrics.
    Entries at padding ids (-1), ids ``>= vocab_size`` (when given) or non-finite teacher log-probs are
    ignored."""
    if not (student_topk_log_probs.shape == teacher_topk_ids.shape == teacher_topk_log_probs.shape):
        raise ValueError(
            f"student_topk_log_probs {tuple(student_topk_log_probs.shape)}, teacher_topk_ids "
            f"{tuple(teacher_topk_ids.shape)} and teacher_topk_log_probs {tuple(teacher_topk_log_probs.shape)} "
            "must have one shape"
        )
    if teacher_topk_ids.dtype.is_floating_point or teacher_topk_ids.dtype == torch.bool:
        raise TypeError(f"teacher_topk_ids must be an integer tensor, got {teacher_topk_ids.dtype}")
    ids = teacher_topk_ids.to(student_topk_log_probs.device).long()
    in_vocab = (ids >= 0) if vocab_size is None else (ids >= 0) & (ids < vocab_size)
    return _topk_terms(student_topk_log_probs.float(), in_vocab, teacher_topk_log_probs, loss_mask)


def topk_student_log_probs(
    logits: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    *,
    vocab_start: int = 0,
    reduce_sum: Any = None,
    reduce_max: Any = None,
) -> torch.Tensor:
    """The student's full-vocabulary log-probs at the teacher's ids, ``[..., k]``, without materialising a
    log-softmax: ``logit[id] - logsumexp(logits)`` in fp32 (a -inf logit gives -inf; padding ids give
    a finite value that the loss ignores).

    For vocabulary-parallel logits (tensor parallelism) ``logits`` is this rank's shard ``[..., V_local]``
    starting at ``vocab_start``; ``reduce_sum`` / ``reduce_max`` are the group's all-reduces (sum with an
    identity backward, as Megatron's ``reduce_from_tensor_model_parallel_region``; max on detached
    values). Each id is read on the rank that owns it and summed in. Without them (one shard) the whole
    vocabulary is local.
    """
    if logits.shape[:-1] != teacher_topk_ids.shape[:-1]:
        raise ValueError(f"logits leading shape {tuple(logits.shape[:-1])} != teacher top-k leading shape "
                         f"{tuple(teacher_topk_ids.shape[:-1])}")
    z = logits.float()
    local_vocab = z.shape[-1]
    with torch.no_grad():
        m = z.max(dim=-1, keepdim=True).values
        if reduce_max is not None:
            m = reduce_max(m)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    sum_exp = (z - m).exp().sum(dim=-1, keepdim=True)
    if reduce_sum is not None:
        sum_exp = reduce_sum(sum_exp)
    lse = m + sum_exp.log()
    ids = teacher_topk_ids.to(z.device).long() - vocab_start
    owned = (ids >= 0) & (ids < local_vocab)
    picked = torch.gather(z, -1, torch.where(owned, ids, torch.zeros_like(ids)))
    picked = torch.where(owned, picked, torch.zeros_like(picked))
    if reduce_sum is not None:
        picked = reduce_sum(picked)
    return picked - lse


def _topk_terms(
    s_lp: torch.Tensor,
    in_vocab: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    loss_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token loss and metrics from gathered student log-probs ``s_lp [..., k]``."""
    t_lp = teacher_topk_log_probs.to(device=s_lp.device, dtype=torch.float32)
    valid = in_vocab & torch.isfinite(t_lp)
    zero = torch.zeros_like(s_lp)
    t_lp_safe = torch.where(valid, t_lp, zero)
    # P_S(v) = 0 (a -inf student logit, e.g. a masked vocabulary entry): 0 * log 0 = 0, so the entry
    # contributes P_T(v). Computing exp(-inf) * (-inf - t) instead gives NaN, and its gradient is NaN
    # even where the value is masked out; the log-prob is replaced *before* any arithmetic, so neither
    # the value nor the gradient sees it (d/dlogit of such an entry is 0). NaN stays NaN (only -inf).
    s_zero = torch.isneginf(s_lp)
    s_lp_safe = torch.where(s_zero, zero, s_lp)
    p_s = torch.where(s_zero, zero, s_lp_safe.exp())
    p_t = t_lp_safe.exp()
    term = p_s * (s_lp_safe - t_lp_safe) - p_s + p_t
    per_token = torch.where(valid, term, zero).sum(-1)
    if loss_mask is None:
        mask = torch.ones_like(per_token)
    else:
        if loss_mask.shape != per_token.shape:
            raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != token shape {tuple(per_token.shape)}")
        mask = loss_mask.to(device=per_token.device, dtype=torch.float32)
    # select, not multiply: a masked token's value never reaches the loss (NaN * 0 is NaN)
    per_token = torch.where(mask != 0, per_token * mask, torch.zeros_like(per_token))
    with torch.no_grad():
        denom = mask.sum().clamp(min=1.0)
        metrics = {
            "topk_kl": per_token.detach().sum() / denom,
            "student_topk_mass": (torch.where(valid, p_s, zero).sum(-1) * mask).sum() / denom,
            "teacher_topk_mass": (torch.where(valid, p_t, zero).sum(-1) * mask).sum() / denom,
            "valid_topk": (valid.float().sum(-1) * mask).sum() / denom,
        }
    return per_token, metrics


# --------------------------------------------------------------------------------------------
# Payload helpers (top-k only, never full-vocabulary logits)
# --------------------------------------------------------------------------------------------
def pack_topk_payload(
    ids: torch.Tensor,
    log_probs: torch.Tensor,
    *,
    max_k: int = MAX_TOPK,
) -> dict[str, Any]:
    """Pack ``[T, k]`` teacher top-k ids (-1 = pad) and log-probs into a CPU, picklable dict.

    ids are stored as int32, log-probs as float32. ``k > max_k`` is refused: the payload is
    meant for a truncated top-k, not full-vocabulary logits.
    """
    if not isinstance(ids, torch.Tensor) or not isinstance(log_probs, torch.Tensor):
        raise TypeError("ids and log_probs must be torch.Tensor")
    if ids.dim() != 2 or ids.shape != log_probs.shape:
        raise ValueError(
            f"ids and log_probs must both be [T, k]; got {tuple(ids.shape)} and {tuple(log_probs.shape)}"
        )
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"ids must be an integer tensor, got {ids.dtype}")
    k = ids.shape[1]
    if k > max_k:
        raise ValueError(
            f"top-k payload with k={k} > max_k={max_k}: send the teacher's top-k only, never full-vocabulary logits"
        )
    if ids.numel() and int(ids.max()) > torch.iinfo(torch.int32).max:
        raise ValueError("token id does not fit in int32")
    return {
        "format": "opd_topk_v1",
        "k": k,
        "ids": ids.detach().to("cpu", torch.int32).contiguous(),
        "log_probs": log_probs.detach().to("cpu", torch.float32).contiguous(),
    }


def unpack_topk_payload(
    payload: Mapping[str, Any], device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_topk_payload`: ``(ids int64 [T, k], log_probs float32 [T, k])``."""
    if not isinstance(payload, Mapping) or payload.get("format") != "opd_topk_v1":
        raise ValueError("payload is not an opd_topk_v1 dict (build it with pack_topk_payload)")
    ids, lps = payload["ids"], payload["log_probs"]
    if ids.shape != lps.shape or ids.dim() != 2 or ids.shape[1] != payload["k"]:
        raise ValueError(f"corrupt top-k payload: ids {tuple(ids.shape)}, log_probs {tuple(lps.shape)}, k={payload['k']}")
    return ids.to(device=device, dtype=torch.long), lps.to(device=device, dtype=torch.float32)


def topk_payload_from_sglang(
    input_top_logprobs: Sequence[Any],
    response_length: int,
    k: int | None = None,
) -> dict[str, Any]:
    """Build a top-k payload from SGLang ``meta_info["input_top_logprobs"]``.

    SGLang (``return_logprob=True, top_logprobs_num=k, logprob_start_len=0``) returns one entry
    per input position; each is ``None`` (first position) or a list of ``(logprob, token_id,
    text)``. As in slime's ``post_process_rewards``, the first entry is dropped and the last
    ``response_length`` entries are kept. Shorter rows are padded with id -1.
    """
    entries = list(input_top_logprobs)[1:]
    if response_length > len(entries):
        raise ValueError(f"response_length {response_length} > {len(entries)} scored positions")
    rows = entries[len(entries) - response_length :] if response_length else []
    kk = k if k is not None else max((len(r) for r in rows if r), default=0)
    ids = torch.full((response_length, kk), -1, dtype=torch.int32)
    lps = torch.full((response_length, kk), float("-inf"), dtype=torch.float32)
    for i, row in enumerate(rows):  # host-side parsing of JSON lists, not a tensor fast path
        for j, item in enumerate((row or [])[:kk]):
            lps[i, j] = float(item[0])
            ids[i, j] = int(item[1])
    return pack_topk_payload(ids, lps)

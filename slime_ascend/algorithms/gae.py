"""Generalised advantage estimation for agentic RL (SAO skip-observation GAE, CompactionRL segment decay).

All functions are pure torch, device-neutral and free of Python loops over tokens.

Conventions (response-aligned, one 1-D tensor per sample, as in slime's ``rollout_data``):

* ``loss_mask == 1`` marks an *action* token (sampled by the policy, trainable); ``0`` marks an
  observation / tool token.
* Skip-observation GAE treats only action tokens as time steps: the last token of one action span is
  followed directly by the first token of the next one. This equals deleting the observation tokens and
  running ordinary token-level GAE, bootstrapping 0 after the last action token.
* Values at observation positions are ignored. Advantages and returns at observation positions are 0.
* Rewards at observation positions are ignored by default (``observation_rewards="ignore"``); with
  ``"credit_previous_action"`` they are added to the nearest preceding action token of the same sample
  (rewards on observations that precede every action are dropped). Put terminal rewards on the last
  action token with :func:`terminal_rewards_on_last_action`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Literal

import torch

from .cp import cp_full_vectors, cp_slice

__all__ = [
    "apply_segment_decay",
    "cp_skip_observation_gae",
    "length_adaptive_lambda",
    "length_adaptive_lambdas",
    "segment_decay_factors",
    "skip_observation_gae",
    "terminal_rewards_on_last_action",
    "token_gae",
    "trainable_token_counts",
]

ObservationRewards = Literal["ignore", "credit_previous_action"]


# ----------------------------------------------------------------------------------------------
# discounted reverse cumulative sum
# ----------------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reverse_scan(x: torch.Tensor, discount: Sequence[float], chunk_size: int) -> torch.Tensor:
    """y[:, t] = x[:, t] + d * y[:, t+1] for a 2-D ``x`` and one discount per row (Python floats).

    Hierarchical chunked scan: a C x C matmul inside each chunk, then the chunk heads form a scan of the
    same kind with discount d**C, solved recursively (depth log_C T). Only non-negative powers d**k with
    k <= C appear, so nothing overflows for d in [0, 1] however long the sequence.
    """
    B, T = x.shape
    if T == 0:
        return x.clone()
    C = min(chunk_size, T)
    n = -(-T // C)
    pad = n * C - T
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    chunks = x.view(B, n, C)

    uniform = all(d == discount[0] for d in discount)
    dd = torch.tensor(discount[:1] if uniform else list(discount), dtype=x.dtype, device=x.device)  # [1] or [B]
    idx = torch.arange(C, device=x.device)
    diff = idx[None, :] - idx[:, None]  # diff[i, j] = j - i
    # M[b, i, j] = d_b ** (j - i) for j >= i, else 0.   0 ** 0 == 1 keeps the diagonal for d == 0.
    M = torch.where(diff >= 0, dd[:, None, None] ** diff.clamp(min=0).to(x.dtype), 0.0)
    # local[b, c, i] = sum_j M[b, i, j] * chunks[b, c, j]: the scan restricted to chunk c
    if uniform:
        local = chunks @ M[0].transpose(0, 1)
    else:
        local = torch.bmm(chunks, M.transpose(1, 2))
    if n == 1:
        return local.reshape(B, C)[:, :T]

    # y at the head of chunk c: heads_y[c] = local[c, 0] + d**C * heads_y[c + 1]
    heads_y = _reverse_scan(local[:, :, 0].contiguous(), [d**C for d in discount], chunk_size)
    carry = torch.nn.functional.pad(heads_y[:, 1:], (0, 1))  # y at the head of the next chunk; 0 after the end
    # y[c, i] = local[c, i] + d ** (C - i) * carry[c]
    pow_vec = dd[:, None] ** (C - idx).to(x.dtype)  # [1 or B, C]
    y = torch.addcmul(local, carry[:, :, None], pow_vec[:, None, :])
    return y.reshape(B, n * C)[:, :T]


def _check_chunk_size(chunk_size: int) -> None:
    if int(chunk_size) < 2:
        raise ValueError(f"chunk_size must be >= 2, got {chunk_size}")


# ----------------------------------------------------------------------------------------------
# lambda schedules and reward placement
# ----------------------------------------------------------------------------------------------


def length_adaptive_lambda(num_trainable_tokens: int, alpha: float = 1.5) -> float:
    """VAPO/SAO length-adaptive policy lambda: ``1 - 1 / (alpha * l)`` clamped to [0, 1].

    ``l`` is the number of trainable (action) tokens. The clamp only matters for tiny ``l``: ``l == 0``
    (nothing to train, the value is irrelevant) gives 0, and ``alpha * l < 1`` gives 0 instead of a
    negative lambda. The critic uses lambda = 1 instead.
    """
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    n = int(num_trainable_tokens)
    if n < 0:
        raise ValueError(f"num_trainable_tokens must be >= 0, got {n}")
    if n == 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - 1.0 / (alpha * n)))


def trainable_token_counts(loss_masks: Sequence[torch.Tensor]) -> list[int]:
    """Trainable (action) tokens per sample: the nonzero entries of each full-length loss mask."""
    if len(loss_masks) == 0:
        return []
    return [int(c) for c in torch.stack([(torch.as_tensor(m) != 0).sum() for m in loss_masks]).tolist()]


def length_adaptive_lambdas(
    loss_masks: Sequence[torch.Tensor], alpha: float = 1.5, rollout_trainable_tokens: Sequence[int] | None = None
) -> list[float]:
    """Per-sample :func:`length_adaptive_lambda`: ``l`` is the rollout's trainable tokens when
    ``rollout_trainable_tokens`` is given (one total per sample, e.g. CompactionRL's over all segments of
    the rollout, so every segment gets its rollout's lambda), else the sample's own ``loss_mask`` count."""
    if rollout_trainable_tokens is not None:
        if len(rollout_trainable_tokens) != len(loss_masks):
            raise ValueError(
                f"rollout_trainable_tokens has {len(rollout_trainable_tokens)} entries for {len(loss_masks)} samples"
            )
        counts = [int(c) for c in rollout_trainable_tokens]
    else:
        counts = trainable_token_counts(loss_masks)
    return [length_adaptive_lambda(c, alpha) for c in counts]


def terminal_rewards_on_last_action(
    scalar_rewards: Sequence[float] | torch.Tensor,
    loss_masks: Sequence[torch.Tensor],
    token_rewards: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Per-token reward vectors: ``token_rewards`` (e.g. ``-kl_coef * kl``, default 0) plus each sample's
    scalar reward on its last action token. A sample without action tokens gets no terminal reward."""
    B = len(loss_masks)
    if len(scalar_rewards) != B:
        raise ValueError(f"scalar_rewards has {len(scalar_rewards)} entries, loss_masks has {B}")
    if token_rewards is not None and len(token_rewards) != B:
        raise ValueError(f"token_rewards has {len(token_rewards)} entries, loss_masks has {B}")
    out = []
    for i, m in enumerate(loss_masks):
        if token_rewards is not None:
            if token_rewards[i].shape != m.shape:
                raise ValueError(f"token_rewards[{i}] shape {tuple(token_rewards[i].shape)} != loss_masks shape")
            r = token_rewards[i].clone()
        else:
            r = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
        mb = m != 0
        if m.numel():
            # last action token found without a host sync; adds 0 when the sample has no action token
            last = m.numel() - 1 - torch.flip(mb, dims=[0]).to(torch.int8).argmax()
            reward = torch.as_tensor(scalar_rewards[i], dtype=r.dtype, device=r.device)
            r[last] += torch.where(mb.any(), reward, torch.zeros_like(reward))
        out.append(r)
    return out


# ----------------------------------------------------------------------------------------------
# skip-observation GAE
# ----------------------------------------------------------------------------------------------


def _per_sample_lambdas(lambd: float | Sequence[float], B: int) -> list[float]:
    if isinstance(lambd, (int, float)):
        lams = [float(lambd)] * B
    else:
        lams = [float(v) for v in lambd]
        if len(lams) != B:
            raise ValueError(f"lambd has {len(lams)} entries, expected one per sample ({B}) or a single float")
    for v in lams:
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"lambd must lie in [0, 1], got {v}")
    return lams


@torch.no_grad()
def skip_observation_gae(
    values: Sequence[torch.Tensor],
    rewards: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    gamma: float,
    lambd: float | Sequence[float],
    *,
    observation_rewards: ObservationRewards = "ignore",
    chunk_size: int = 128,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Token-level GAE over action tokens only (SAO skip-observation GAE), batched over samples.

    Args:
        values, rewards, loss_masks: per-sample 1-D response-aligned tensors of equal length.
        gamma: discount in [0, 1].
        lambd: GAE lambda in [0, 1], a float or one per sample (see :func:`length_adaptive_lambdas`).
        observation_rewards: what to do with rewards on observation tokens (see module docstring).
        chunk_size: chunk length of the scan.

    Returns:
        ``(advantages, returns)``, per-sample tensors in ``values``' dtype; ``returns = advantages + values``
        on action tokens; both are 0 on observation tokens. Computed without autograd (targets), like slime.
    """
    B = len(values)
    if len(rewards) != B or len(loss_masks) != B:
        raise ValueError(
            f"values, rewards and loss_masks need one tensor per sample; got {B}, {len(rewards)}, {len(loss_masks)}"
        )
    if not 0.0 <= float(gamma) <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    if observation_rewards not in ("ignore", "credit_previous_action"):
        raise ValueError(
            f"observation_rewards must be 'ignore' or 'credit_previous_action', got {observation_rewards!r}"
        )
    lams = _per_sample_lambdas(lambd, B)
    _check_chunk_size(chunk_size)
    if B == 0:
        return [], []
    for i in range(B):
        if values[i].ndim != 1 or values[i].shape != rewards[i].shape or values[i].shape != loss_masks[i].shape:
            raise ValueError(
                f"sample {i}: values, rewards and loss_masks must be 1-D of equal length; got "
                f"{tuple(values[i].shape)}, {tuple(rewards[i].shape)}, {tuple(loss_masks[i].shape)}"
            )
    out_dtype = values[0].dtype
    device = values[0].device
    cdtype = _compute_dtype(out_dtype)
    lengths = [int(v.numel()) for v in values]

    def flat(xs: Sequence[torch.Tensor], dtype: torch.dtype | None) -> torch.Tensor:
        xs = [x.to(device=device, dtype=dtype) if dtype is not None else x.to(device) for x in xs]
        return xs[0] if B == 1 else torch.cat(xs)

    v_flat = flat(values, cdtype)
    r_flat = flat(rewards, cdtype)
    m_flat = flat(loss_masks, None) != 0
    act_pos = m_flat.nonzero().squeeze(1)
    n_act = act_pos.numel()

    # per-sample action counts from one cumulative sum (no per-token sample ids needed)
    lengths_t = torch.tensor(lengths, device=device)
    ends = torch.cumsum(lengths_t, 0)
    cs0 = torch.nn.functional.pad(torch.cumsum(m_flat, 0), (1, 0))
    starts = cs0[ends - lengths_t]  # compacted index of each sample's first action
    counts = cs0[ends] - starts
    L = n_act if B == 1 else (int(counts.max()) if n_act else 0)

    # Compacted actions go to a [B, L + 1] buffer; the extra zero column bootstraps 0 after the last action.
    # dest = flat index of each action (in compacted order) in that buffer.
    if B == 1:
        dest: torch.Tensor | slice = slice(0, n_act)
    else:
        offsets = torch.arange(B, device=device) * (L + 1) - starts
        dest = torch.arange(n_act, device=device) + torch.repeat_interleave(offsets, counts, output_size=n_act)
    v_act = v_flat[act_pos]
    V = torch.zeros(B * (L + 1), dtype=cdtype, device=device)
    R = torch.zeros(B * (L + 1), dtype=cdtype, device=device)
    V[dest] = v_act
    if observation_rewards == "ignore":
        R[dest] = r_flat[act_pos]
    else:
        # every token credits the latest action at or before it in the same sample
        sample_of_token = torch.repeat_interleave(torch.arange(B, device=device), lengths_t, output_size=len(m_flat))
        seen = cs0[1:] - starts[sample_of_token]
        keep = seen >= 1
        R.index_put_((sample_of_token[keep] * (L + 1) + seen[keep] - 1,), r_flat[keep], accumulate=True)
    V = V.view(B, L + 1)
    deltas = R.view(B, L + 1) - V
    deltas[:, :-1].add_(V[:, 1:], alpha=float(gamma))
    A = _reverse_scan(deltas, [float(gamma) * lam for lam in lams], chunk_size)

    a_act = A.reshape(-1)[dest]
    adv_flat = torch.zeros_like(v_flat)
    ret_flat = torch.zeros_like(v_flat)
    adv_flat[act_pos] = a_act
    ret_flat[act_pos] = a_act + v_act
    advantages = list(adv_flat.to(out_dtype).split(lengths))
    returns = list(ret_flat.to(out_dtype).split(lengths))
    return advantages, returns


@torch.no_grad()
def cp_skip_observation_gae(
    values: Sequence[torch.Tensor],
    kl: Sequence[torch.Tensor],
    rewards: Sequence[float],
    loss_masks: Sequence[torch.Tensor],
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    *,
    gamma: float,
    lambdas: float | Sequence[float],
    kl_coef: float = 0.0,
    cp_rank: int = 0,
    cp_size: int = 1,
    all_gather: Callable[[torch.Tensor], list[torch.Tensor]] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Skip-observation GAE on context-parallel-local ``values`` / ``kl``; returns CP-local float32
    ``(advantages, returns)``.

    The layout is slime's train-side one (:mod:`slime_ascend.algorithms.cp`): ``values`` and ``kl`` are this
    rank's zig-zag pieces, ``loss_masks`` full response length, ``rewards`` one scalar per sample. The pieces
    are gathered into full vectors (one ``all_gather`` per tensor kind; it must return the equally shaped
    tensors of every CP rank in rank order, needed when ``cp_size > 1``), token rewards are
    ``-kl_coef * kl`` plus the scalar reward on the last action token, :func:`skip_observation_gae` runs on
    the full sequences and the results are sliced back to this rank's layout.
    """
    n = len(values)
    for name, seq in (("kl", kl), ("rewards", rewards), ("loss_masks", loss_masks),
                      ("total_lengths", total_lengths), ("response_lengths", response_lengths)):
        if len(seq) != n:
            raise ValueError(f"cp_skip_observation_gae: {name} has {len(seq)} entries, values has {n}")
    full_v = cp_full_vectors(values, total_lengths, response_lengths, cp_rank, cp_size, all_gather)
    full_kl = cp_full_vectors(kl, total_lengths, response_lengths, cp_rank, cp_size, all_gather)
    masks = []
    for i, (m, v) in enumerate(zip(loss_masks, full_v, strict=True)):
        m = torch.as_tensor(m).to(v.device)
        if m.shape != v.shape:
            raise ValueError(
                f"sample {i}: loss_mask has {tuple(m.shape)} entries, the gathered values {tuple(v.shape)}; "
                "loss_masks must be full response length"
            )
        masks.append(m)
    token_rewards = [k.to(torch.float32) * -float(kl_coef) for k in full_kl]
    per_token = terminal_rewards_on_last_action([float(r) for r in rewards], masks, token_rewards)
    adv, ret = skip_observation_gae([v.to(torch.float32) for v in full_v], per_token, masks, gamma, lambdas)
    if cp_size > 1:
        shapes = list(zip(total_lengths, response_lengths, strict=True))
        adv = [cp_slice(a, cp_rank, cp_size, t, r) for a, (t, r) in zip(adv, shapes, strict=True)]
        ret = [cp_slice(x, cp_rank, cp_size, t, r) for x, (t, r) in zip(ret, shapes, strict=True)]
    return adv, ret


def token_gae(
    values: Sequence[torch.Tensor],
    rewards: Sequence[torch.Tensor],
    gamma: float,
    lambd: float | Sequence[float],
    *,
    chunk_size: int = 128,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Ordinary token-level GAE over every response token (slime's ``chunked_gae`` semantics)."""
    masks = [torch.ones(v.shape, dtype=torch.bool, device=v.device) for v in values]
    return skip_observation_gae(values, rewards, masks, gamma, lambd, chunk_size=chunk_size)


# ----------------------------------------------------------------------------------------------
# CompactionRL cross-segment decay
# ----------------------------------------------------------------------------------------------


def segment_decay_factors(
    rollout_ids: Sequence[Hashable],
    segment_indices: Sequence[int],
    trainable_counts: Sequence[int],
    gamma: float,
    lambd: float | Sequence[float],
) -> list[float]:
    """CompactionRL factor ``(gamma * lambda) ** N_after(s)`` for every segment entry.

    ``N_after(s)`` is the number of trainable tokens in the segments of the same rollout that come later
    (larger ``segment_indices``; only the order matters). Inputs are per-segment metadata, e.g. gathered
    from every data-parallel rank, in any order. ``lambd`` is a float or one value per entry, which must
    be identical within a rollout (one lambda per rollout; see :func:`length_adaptive_lambdas`).
    """
    n = len(rollout_ids)
    if len(segment_indices) != n or len(trainable_counts) != n:
        raise ValueError(
            "rollout_ids, segment_indices and trainable_counts must have the same length; got "
            f"{n}, {len(segment_indices)}, {len(trainable_counts)}"
        )
    if not 0.0 <= float(gamma) <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    lams = _per_sample_lambdas(lambd, n)
    by_rollout: dict[Hashable, list[int]] = {}
    for k, rid in enumerate(rollout_ids):
        if int(trainable_counts[k]) < 0:
            raise ValueError(f"trainable_counts[{k}] must be >= 0, got {trainable_counts[k]}")
        by_rollout.setdefault(rid, []).append(k)
    factors = [0.0] * n
    for rid, entries in by_rollout.items():
        lam = lams[entries[0]]
        if any(lams[k] != lam for k in entries):
            raise ValueError(f"rollout {rid!r}: lambd differs between its segments; use one lambda per rollout")
        order = sorted(entries, key=lambda k: segment_indices[k])
        seg_idx = [segment_indices[k] for k in order]
        if len(set(seg_idx)) != len(seg_idx):
            raise ValueError(f"rollout {rid!r}: duplicate segment index in {seg_idx}")
        base = float(gamma) * lam
        after = 0
        for k in reversed(order):
            factors[k] = 1.0 if after == 0 else (0.0 if base == 0.0 else math.pow(base, after))
            after += int(trainable_counts[k])
    return factors


def apply_segment_decay(advantages: Sequence[torch.Tensor], factors: Sequence[float]) -> list[torch.Tensor]:
    """Scale each segment's local advantages by its :func:`segment_decay_factors` entry."""
    if len(advantages) != len(factors):
        raise ValueError(f"advantages has {len(advantages)} entries, factors has {len(factors)}")
    return [a * float(f) for a, f in zip(advantages, factors, strict=True)]


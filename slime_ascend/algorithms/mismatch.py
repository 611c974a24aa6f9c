"""Train/rollout log-prob mismatch statistics over masked tokens, in a form that merges across ranks.

Inputs are lists of per-sample 1-D tensors (slime's ``log_probs``, ``rollout_log_probs``,
``loss_masks``), plus optional per-sample keep masks (e.g. a DIS or IcePop keep mask) whose rejected
share is reported. Let Δ = logp_train - logp_rollout on tokens with loss_mask != 0, computed in fp32
(fp64 if an input is fp64). Tokens whose Δ is not finite are counted in ``nonfinite_frac`` and excluded
from every other statistic.

Statistics (all token-weighted over the whole batch unless the name says ``seq_``):
    ``tokens``                finite masked tokens.
    ``nonfinite_frac``        masked tokens with NaN/inf Δ / all masked tokens.
    ``logratio_mean``         mean Δ (= -k1 estimate of KL(π_rollout‖π_train)).
    ``logratio_abs_mean``     mean |Δ|.
    ``logratio_abs_p99``      (:func:`mismatch_stats` only) exact nearest-rank 99th percentile of |Δ|:
                              the ceil(0.99·n)-th smallest value.
    ``logratio_abs_p99_upper`` upper edge of the histogram bin holding that rank; exact p99 <= this <=
                              p99 · 10^(1/20) (bins are log-spaced, 20 per decade, from 1e-8 to 1e2;
                              values below 1e-8 report 1e-8, above 1e2 report inf). Mergeable.
    ``k3_kl``                 mean of exp(Δ) - 1 - Δ: the k3 estimator of KL(π_rollout‖π_train) for
                              tokens sampled from π_rollout (>= 0). Δ is clamped to [-20, 20] here, as
                              slime's mis.py does, so one extreme token cannot overflow the batch.
    ``ess``                   (Σw)² / (n·Σw²) with w = exp(clamp(Δ, ±20)): effective sample size of the
                              importance weights π_train/π_rollout, normalised to (0, 1].
    ``masked_frac``           (only with keep masks) masked tokens whose keep mask is False / all masked
                              tokens (non-finite ones included).
    ``seq_logratio_abs_mean`` mean over samples of each sample's mean |Δ| (samples with no finite
                              masked token skipped); a mean of means, labelled as such.

Merging: :func:`mismatch_sums` returns :class:`MismatchSums` of plain sums and counts; add them
(``merge``), or all-reduce ``to_tensor()`` with SUM and rebuild with ``MismatchSums.from_tensor``, then
``finalize()``. Every statistic except the exact p99 is then identical to one computed on the union.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from .masks import log_ratio

__all__ = ["HIST_EDGES", "MismatchSums", "mismatch_sums", "mismatch_stats", "SAFETY_BOUND"]

#: Clamp on Δ before exponentiation (same value as slime's mis.py).
SAFETY_BOUND = 20.0
#: |Δ| histogram edges: 10**(-8 + j/20), j = 0..200 (1e-8 .. 1e2), rounded to fp32 so that fp32 and
#: fp64 bucketing agree. Bin 0 is [0, e[0]), bin i is [e[i-1], e[i]), the last bin is [e[200], inf).
HIST_EDGES: tuple[float, ...] = tuple(
    torch.tensor([10.0 ** (-8 + j / 20) for j in range(201)], dtype=torch.float32).tolist()
)
_N_BINS = len(HIST_EDGES) + 1


@dataclass
class MismatchSums:
    """Additive sufficient statistics (0-d tensors, and ``hist`` of shape [len(HIST_EDGES) + 1])."""

    masked_tokens: torch.Tensor
    tokens: torch.Tensor
    sum_delta: torch.Tensor
    sum_abs: torch.Tensor
    sum_k3: torch.Tensor
    sum_w: torch.Tensor
    sum_w2: torch.Tensor
    rejected: torch.Tensor
    has_keep: torch.Tensor
    seqs: torch.Tensor
    sum_seq_abs_mean: torch.Tensor
    hist: torch.Tensor

    def to_tensor(self) -> torch.Tensor:
        """Flat vector (scalars in field order, then hist) for an all-reduce with SUM."""
        return torch.cat([getattr(self, f.name).reshape(-1) for f in fields(self)])

    @classmethod
    def from_tensor(cls, vec: torch.Tensor) -> MismatchSums:
        names = [f.name for f in fields(cls)]
        n_scalar = len(names) - 1
        if vec.dim() != 1 or vec.numel() != n_scalar + _N_BINS:
            raise ValueError(f"vec must be 1-D of length {n_scalar + _N_BINS}, got shape {tuple(vec.shape)}")
        vals = {n: vec[i] for i, n in enumerate(names[:-1])}
        return cls(**vals, hist=vec[n_scalar:])

    def merge(self, other: MismatchSums) -> MismatchSums:
        return MismatchSums.from_tensor(self.to_tensor() + other.to_tensor().to(self.hist))

    def finalize(self) -> dict[str, float]:
        """The statistics named in the module docstring (``masked_frac`` only if keep masks were given)."""
        n = float(self.tokens)
        all_masked = float(self.masked_tokens)
        nan = math.nan
        out = {
            "tokens": n,
            "nonfinite_frac": (all_masked - n) / all_masked if all_masked > 0 else nan,
            "logratio_mean": float(self.sum_delta) / n if n > 0 else nan,
            "logratio_abs_mean": float(self.sum_abs) / n if n > 0 else nan,
            "logratio_abs_p99_upper": _hist_quantile_upper(self.hist, 0.99),
            "k3_kl": float(self.sum_k3) / n if n > 0 else nan,
            "ess": float(self.sum_w) ** 2 / (n * float(self.sum_w2)) if n > 0 and float(self.sum_w2) > 0 else nan,
            "seq_logratio_abs_mean": float(self.sum_seq_abs_mean) / float(self.seqs) if float(self.seqs) > 0 else nan,
        }
        if float(self.has_keep) > 0:
            out["masked_frac"] = float(self.rejected) / all_masked if all_masked > 0 else nan
        return out


def _nearest_rank(n: int, q: float) -> int:
    """ceil(q·n) computed exactly for q given in whole per-mille (e.g. 0.99), at least 1."""
    permille = int(round(q * 1000))
    return max(1, -(-permille * n // 1000))


def _hist_quantile_upper(hist: torch.Tensor, q: float) -> float:
    counts = hist.double().cpu()
    total = float(counts.sum())
    if total <= 0:
        return math.nan
    rank = _nearest_rank(int(round(total)), q)
    b = int(torch.searchsorted(torch.cumsum(counts, 0), torch.tensor(float(rank), dtype=torch.float64)))
    return HIST_EDGES[b] if b < len(HIST_EDGES) else math.inf


def _check_lists(
    train_logp: Sequence[torch.Tensor],
    rollout_logp: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    keep_masks: Sequence[torch.Tensor] | None,
) -> None:
    named = [("train_logp", train_logp), ("rollout_logp", rollout_logp), ("loss_masks", loss_masks)]
    if keep_masks is not None:
        named.append(("keep_masks", keep_masks))
    n = len(train_logp)
    for name, seq in named:
        if isinstance(seq, torch.Tensor):
            raise TypeError(f"{name} must be a list of per-sample 1-D tensors, not a tensor")
        if len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} samples, train_logp has {n}")
    for i in range(n):
        ref = train_logp[i]
        for name, seq in named:
            t = seq[i]
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape != ref.shape:
                raise ValueError(
                    f"{name}[{i}] must be a 1-D tensor shaped like train_logp[{i}] "
                    f"({tuple(ref.shape) if isinstance(ref, torch.Tensor) else '?'})"
                    f", got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                )
        for name in ("train_logp", "rollout_logp"):
            if not dict(named)[name][i].is_floating_point():
                raise TypeError(f"{name}[{i}] must be a float tensor of log-probs")


def _prepare(train_logp, rollout_logp, loss_masks, keep_masks):
    _check_lists(train_logp, rollout_logp, loss_masks, keep_masks)
    lengths = [t.numel() for t in train_logp]
    if not lengths:  # empty batch: zero sums on the CPU
        empty = [torch.zeros(0)]
        train_logp, rollout_logp, loss_masks = empty, empty, empty
        keep_masks = None if keep_masks is None else empty
    a = torch.cat([t.detach().reshape(-1) for t in train_logp])
    delta = log_ratio(a, torch.cat([t.detach().reshape(-1) for t in rollout_logp]).to(a.device))
    m = torch.cat([t.reshape(-1) for t in loss_masks]).to(delta.device) != 0
    keep = None if keep_masks is None else torch.cat([t.reshape(-1) for t in keep_masks]).to(delta.device) != 0
    seg = torch.repeat_interleave(
        torch.arange(len(lengths), device=delta.device), torch.tensor(lengths, device=delta.device, dtype=torch.long)
    )
    return delta, m, keep, seg, len(lengths)


def mismatch_sums(
    train_logp: Sequence[torch.Tensor],
    rollout_logp: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    keep_masks: Sequence[torch.Tensor] | None = None,
    *,
    accum_dtype: torch.dtype = torch.float64,
) -> MismatchSums:
    """Mergeable sums for one batch (see module docstring). Tensors stay on the inputs' device.

    ``accum_dtype`` is the dtype of the returned sums (use float32 on a device without float64;
    counts are then exact only up to 2**24 tokens).
    """
    delta, m, keep, seg, n_seq = _prepare(train_logp, rollout_logp, loss_masks, keep_masks)
    dev = delta.device
    fin = m & torch.isfinite(delta)
    d = torch.where(fin, delta, torch.zeros_like(delta))
    dc = d.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    w = torch.where(fin, torch.exp(dc), torch.zeros_like(d))
    k3 = torch.where(fin, torch.expm1(dc) - dc, torch.zeros_like(d))
    absd = d.abs()

    seq_tok = torch.zeros(n_seq, dtype=d.dtype, device=dev).index_add_(0, seg, fin.to(d.dtype))
    seq_abs = torch.zeros(n_seq, dtype=d.dtype, device=dev).index_add_(0, seg, absd)
    has = seq_tok > 0
    seq_means = torch.where(has, seq_abs / seq_tok.clamp(min=1), torch.zeros_like(seq_abs))

    edges = torch.tensor(HIST_EDGES, dtype=d.dtype, device=dev)
    bins = torch.bucketize(absd[fin], edges, right=True)
    hist = torch.bincount(bins, minlength=_N_BINS)

    def s(x: torch.Tensor) -> torch.Tensor:
        return x.sum().to(accum_dtype)

    rejected = (m & ~keep).sum() if keep is not None else torch.zeros((), device=dev)
    return MismatchSums(
        masked_tokens=s(m),
        tokens=s(fin),
        sum_delta=s(d),
        sum_abs=s(absd),
        sum_k3=s(k3),
        sum_w=s(w),
        sum_w2=s(w * w),
        rejected=rejected.to(accum_dtype),
        has_keep=torch.tensor(1.0 if keep is not None else 0.0, dtype=accum_dtype, device=dev),
        seqs=s(has),
        sum_seq_abs_mean=s(seq_means),
        hist=hist.to(accum_dtype),
    )


def mismatch_stats(
    train_logp: Sequence[torch.Tensor],
    rollout_logp: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    keep_masks: Sequence[torch.Tensor] | None = None,
) -> dict[str, float]:
    """Single-process statistics: ``mismatch_sums(...).finalize()`` plus the exact ``logratio_abs_p99``."""
    out = mismatch_sums(train_logp, rollout_logp, loss_masks, keep_masks).finalize()
    delta, m, _, _, _ = _prepare(train_logp, rollout_logp, loss_masks, keep_masks)
    absd = delta[m & torch.isfinite(delta)].abs()
    if absd.numel() == 0:
        out["logratio_abs_p99"] = math.nan
    else:
        rank = _nearest_rank(absd.numel(), 0.99)
        out["logratio_abs_p99"] = float(torch.sort(absd).values[rank - 1])
    return out

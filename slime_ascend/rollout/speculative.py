"""Speculative decoding's accept rule, pure (tensors in, tokens out): a draft proposes ``K`` tokens, the target scores
them in one forward, and the tokens kept follow the **target's** distribution exactly.

* :func:`sampling_distribution`: the distribution a sampler draws from, after temperature, top-k, top-p and min-p, by
  SGLang's rules (the torch engine's ``_choose_token`` draws from the same one);
* :func:`categorical`: a draw by inverse CDF from one uniform (every random choice here is a function of explicit
  uniforms, so a test can fix them);
* :func:`verify`: the standard rule (Leviathan et al. 2023; Chen et al. 2023). Draft token ``x_i`` is kept with
  probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection a token is drawn from ``norm(max(0, p_i - q_i))``
  and the step ends; when all ``K`` are kept a bonus token is drawn from ``p_K``. Each kept or drawn token is
  distributed as the target would have sampled it alone. Greedy (``q`` None): a draft token is kept while it is the
  target's argmax, and the step ends with the target's argmax.

The log-probs reported for the tokens are the target's (the caller reads them from the verifying forward's rows), so
an RL trainer sees the policy's numbers, not the draft's.
"""

from __future__ import annotations

import torch

__all__ = ["categorical", "keep_mask", "sampling_distribution", "verify"]


def keep_mask(sorted_probs: torch.Tensor, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Which of the probabilities ``sorted_probs`` (descending) a sampler keeps, by SGLang's rules: top-k; top-p drops
    a token when the mass strictly before it exceeds top_p; min-p relative to the largest; the largest always kept.
    The torch engine's ``_choose_token`` and :func:`sampling_distribution` both filter with it."""
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep &= before <= top_p
    if min_p > 0.0:
        keep &= sorted_probs >= min_p * sorted_probs[0]
    keep[0] = True
    return keep


def sampling_distribution(logits: torch.Tensor, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                          min_p: float = 0.0) -> torch.Tensor:
    """float64 probabilities ``[V]`` of sampling from ``logits [V]``: softmax at ``temperature``, then
    :func:`keep_mask` on the sorted probabilities, renormalised."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    sorted_probs, sorted_ids = torch.sort(probs, descending=True)
    keep = keep_mask(sorted_probs, top_k, top_p, min_p)
    out = torch.zeros_like(probs)
    out[sorted_ids[keep]] = sorted_probs[keep]
    return out / out.sum()


def categorical(probs: torch.Tensor, u: float) -> int:
    """The index whose CDF interval holds ``u`` in ``[0, 1)`` (``probs`` non-negative, any positive sum)."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    index = min(index, probs.numel() - 1)
    while probs[index] <= 0:  # u landed on the boundary of a zero-mass tail: the last token with mass
        index -= 1
    return index


def verify(target: torch.Tensor, draft_tokens: list[int], draft_probs: torch.Tensor | None = None,
           uniforms: torch.Tensor | None = None) -> list[int]:
    """The tokens a speculative step emits: the kept prefix of ``draft_tokens`` and one more.

    ``target``: ``[K + 1, V]``, row ``i`` the target's sampling distribution (:func:`sampling_distribution`) for the
    token after the context and the first ``i`` draft tokens; in greedy mode its logits. ``draft_probs``: ``[K, V]``,
    the draft's sampling distributions its tokens were drawn from (None: greedy). ``uniforms``: ``K + 1`` values in
    ``[0, 1)``, ``K`` acceptance draws then the one for the final token (sampled mode only)."""
    k = len(draft_tokens)
    if target.shape[0] != k + 1:
        raise ValueError(f"target has {target.shape[0]} rows for {k} draft tokens; it needs {k + 1}")
    if draft_probs is None:  # greedy: keep while the draft is the target's argmax
        out = []
        for i, token in enumerate(draft_tokens):
            best = int(torch.argmax(target[i]))
            if best != token:
                return out + [best]
            out.append(token)
        return out + [int(torch.argmax(target[k]))]
    if uniforms is None or uniforms.numel() != k + 1:
        raise ValueError(f"sampled verification needs {k + 1} uniforms")
    out = []
    for i, token in enumerate(draft_tokens):
        p, q = float(target[i, token]), float(draft_probs[i, token])
        if float(uniforms[i]) * q < p:  # kept with probability min(1, p / q)
            out.append(token)
            continue
        residual = torch.clamp(target[i].double() - draft_probs[i].double(), min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q (to rounding): the rejection had probability ~0; draw from p
            residual = target[i].double()
        return out + [categorical(residual, float(uniforms[k]))]
    return out + [categorical(target[k], float(uniforms[k]))]

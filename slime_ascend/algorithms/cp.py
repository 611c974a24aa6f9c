"""Context-parallel (CP) zig-zag layout of response-aligned per-token vectors, as pure functions.

Layout (same semantics as slime's ``cp_utils``): a sample of ``total_length`` tokens (prompt followed by
response) is padded to ``2 * cp_size`` chunks of ``ceil(total_length / (2 * cp_size))`` tokens; CP rank r
owns chunks r and ``2 * cp_size - 1 - r``. A response-aligned vector (log-probs, values, advantages, ...)
has ``response_length`` entries; entry j belongs to the logit at sequence position ``prompt_length - 1 + j``
(the logit that predicts response token j). A rank's local vector is the concatenation of the entries whose
logit positions fall inside its two chunks, in chunk order. ``loss_masks`` stay full length in slime.

Use :func:`cp_unslice` (gather), compute on the full vector, then :func:`cp_slice` (re-slice) to run a
sequence-global algorithm such as GAE under CP.

``--allgather-cp`` (slime's DSA layout) splits the packed stream of a micro-batch contiguously instead: rank r
holds global stream positions ``[r * local_length, (r + 1) * local_length)``, so a rank's logits cover one
contiguous range of each response (:func:`allgather_response_range`, slime's ``get_responses``). slime computes
log-probs there and redistributes them to the zig-zag layout above (``loss._allgather_cp_redistribute``), so
every per-token vector after that, and ``sum_of_sample_mean``, is zig-zag in both layouts;
:func:`allgather_to_zigzag` does the same for a vector computed from the logits directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["allgather_response_range", "allgather_to_zigzag", "cp_full_vectors", "cp_local_length",
           "cp_response_ranges", "cp_slice", "cp_unslice"]


def _check(cp_rank: int | None, cp_size: int, total_length: int, response_length: int) -> None:
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if cp_rank is not None and not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must lie in [0, cp_size={cp_size}), got {cp_rank}")
    if response_length < 0 or total_length - response_length < 1:
        raise ValueError(
            f"need 0 <= response_length < total_length (a prompt of at least one token); "
            f"got total_length={total_length}, response_length={response_length}"
        )


def cp_response_ranges(
    cp_rank: int, cp_size: int, total_length: int, response_length: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Half-open ranges of response indices owned by ``cp_rank`` (first chunk, second chunk).

    An empty range is returned as ``(0, 0)``. With ``cp_size == 1`` the rank owns ``(0, response_length)``.
    """
    _check(cp_rank, cp_size, total_length, response_length)
    if cp_size == 1:
        return (0, response_length), (0, 0)
    prompt_length = total_length - response_length
    chunk = -(-total_length // (2 * cp_size))
    first_logit, end_logit = prompt_length - 1, total_length - 1  # response logits: [P - 1, T - 1)
    out = []
    for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
        lo, hi = max(c * chunk, first_logit), min((c + 1) * chunk, end_logit)
        out.append((lo - first_logit, hi - first_logit) if lo < hi else (0, 0))
    return out[0], out[1]


def cp_local_length(cp_rank: int, cp_size: int, total_length: int, response_length: int) -> int:
    """Length of ``cp_rank``'s local response-aligned vector."""
    (a0, a1), (b0, b1) = cp_response_ranges(cp_rank, cp_size, total_length, response_length)
    return (a1 - a0) + (b1 - b0)


def cp_slice(full: torch.Tensor, cp_rank: int, cp_size: int, total_length: int, response_length: int) -> torch.Tensor:
    """Full response-aligned vector (first dim ``response_length``) -> ``cp_rank``'s local piece."""
    if full.shape[0] != response_length:
        raise ValueError(f"full has {full.shape[0]} entries on dim 0, expected response_length={response_length}")
    (a0, a1), (b0, b1) = cp_response_ranges(cp_rank, cp_size, total_length, response_length)
    return torch.cat([full[a0:a1], full[b0:b1]], dim=0)


def cp_unslice(
    pieces: Sequence[torch.Tensor], cp_size: int, total_length: int, response_length: int
) -> torch.Tensor:
    """Local pieces of every CP rank (index = rank) -> the full response-aligned vector."""
    if len(pieces) != cp_size:
        raise ValueError(f"need one piece per CP rank ({cp_size}), got {len(pieces)}")
    _check(None, cp_size, total_length, response_length)
    ref = pieces[0]
    full = ref.new_zeros((response_length, *ref.shape[1:]))
    for r, piece in enumerate(pieces):
        (a0, a1), (b0, b1) = cp_response_ranges(r, cp_size, total_length, response_length)
        n0, n1 = a1 - a0, b1 - b0
        if piece.shape[0] != n0 + n1:
            raise ValueError(f"piece of rank {r} has {piece.shape[0]} entries, expected {n0 + n1}")
        full[a0:a1] = piece[:n0]
        full[b0:b1] = piece[n0:]
    return full


def cp_full_vectors(
    local: Sequence[torch.Tensor],
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    cp_rank: int,
    cp_size: int,
    all_gather: Callable[[torch.Tensor], list[torch.Tensor]] | None,
) -> list[torch.Tensor]:
    """CP-local response-aligned vectors -> full ones, with one all-gather of this rank's concatenation.

    ``all_gather(x)`` returns the equally shaped tensors of every CP rank in rank order.
    """
    if cp_size == 1:
        return list(local)
    if all_gather is None:
        raise ValueError("cp_size > 1 needs an all_gather callable")
    lens = [[cp_local_length(r, cp_size, t, n) for t, n in zip(total_lengths, response_lengths, strict=True)]
            for r in range(cp_size)]
    for i, x in enumerate(local):
        if x.shape[0] != lens[cp_rank][i]:
            raise ValueError(
                f"sample {i}: local vector has {x.shape[0]} entries, CP rank {cp_rank} owns {lens[cp_rank][i]}"
            )
    width = max(sum(row) for row in lens)
    flat = torch.cat(list(local)) if local else torch.zeros(0)
    padded = torch.nn.functional.pad(flat, (0, width - flat.shape[0]))
    pieces = [g[: sum(row)].split(row) for g, row in zip(all_gather(padded), lens, strict=True)]
    return [
        cp_unslice([pieces[r][i] for r in range(cp_size)], cp_size, t, n)
        for i, (t, n) in enumerate(zip(total_lengths, response_lengths, strict=True))
    ]


def allgather_response_range(cp_rank: int, local_length: int, seq_start: int, total_length: int,
                             response_length: int) -> tuple[int, int]:
    """Half-open range of response indices whose logits ``cp_rank`` holds under ``--allgather-cp``, for the
    sample that starts at ``seq_start`` in the packed stream; ``(0, 0)`` if none."""
    _check(None, 1, total_length, response_length)
    if cp_rank < 0 or local_length < 0:
        raise ValueError(f"need cp_rank >= 0 and local_length >= 0, got {cp_rank}, {local_length}")
    first_logit = seq_start + total_length - response_length - 1  # the logit of response token 0
    lo = max(first_logit, cp_rank * local_length)
    hi = min(first_logit + response_length, (cp_rank + 1) * local_length)
    return (lo - first_logit, hi - first_logit) if lo < hi else (0, 0)


def allgather_to_zigzag(local: Sequence[torch.Tensor], ranges: Sequence[tuple[int, int]],
                        total_lengths: Sequence[int], response_lengths: Sequence[int], cp_rank: int, cp_size: int,
                        all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Per-sample vectors on this rank's ``--allgather-cp`` ranges -> this rank's zig-zag pieces.

    Each piece is placed in a zero vector of its sample's response length, the concatenation is summed over the CP
    group (``all_reduce``; autograd-aware for gradients), and each full vector is cut with :func:`cp_slice`.
    """
    full = []
    for x, (lo, hi), n in zip(local, ranges, response_lengths, strict=True):
        if x.shape[0] != hi - lo:
            raise ValueError(f"a local piece has {x.shape[0]} entries for the response range [{lo}, {hi})")
        full.append(torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (lo, n - hi)))
    summed = all_reduce(torch.cat(full)).split(list(response_lengths))
    return [cp_slice(x, cp_rank, cp_size, t, n)
            for x, t, n in zip(summed, total_lengths, response_lengths, strict=True)]

"""The key sets the DSA indexer selected, as each side records them, and their comparison per layer.

GLM-5's sparse attention reads, for each query position, the keys its lightning indexer selected (``index_topk`` of
them; fewer where the query has fewer past keys). Train and rollout log-probs agree only where both sides select the
same sets (the ``dsa-determinism`` rule: best first, ties to the lower index, masked keys never), in every layer,
IndexShare's reusing layers included. This module holds the two record layouts and compares them; the records are
written by the train actor (``train.dsa_index_dump``, the ``dsa-determinism`` plugin's
``ascend_dsa_index_dump_dir``) and by the torch engine (``serve-torch --dump-dsa-index-sets``).
``slime-ascend dsa-index-sets`` prints the comparison.

* **Train record** (one per call of the sparse attention of one layer on one packed micro-batch): ``layer`` (0-based,
  as in the HF checkpoint), ``cu_seqlens`` (the packed micro-batch's sequence starts, slime's THD layout, its padding
  segment last), ``tokens`` (each sample's token ids, in packing order), ``indices`` (int32 ``[T, k]``: positions in
  the packed sequence, ``-1`` where fewer than ``k`` keys were selected).
* **Rollout record** (one per request): ``tokens`` (the fed token ids: the prompt, then the output but its last),
  ``start`` (positions before it were reused from a prefix cache and not recorded), ``weight_version``, ``layers``
  (layer -> int32 ``[fed - start, k]``: positions in the sequence; a slot may repeat a selected key where fewer than
  ``k`` were selectable, as transformers' indexer fills them).

Both are compared as sets: per query position the distinct non-negative positions, so padding and slot order (which
the attention does not depend on) are not differences. A train sample ``prompt + response`` is matched with the
rollout records whose fed tokens are its tokens but the last; where several match (the same tokens sampled twice, or
under two weight versions), a position differs only if it differs from every one of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["IndexSetComparison", "LayerCount", "canonical_sets", "compare", "load_records", "train_samples"]

TRAIN_GLOB, ROLLOUT_GLOB = "train-*.pt", "rollout-*.pt"


def canonical_sets(indices: torch.Tensor, width: int) -> torch.Tensor:
    """int64 ``[rows, width]``: each row's distinct non-negative entries ascending, then ``-1``. Two rows hold the same
    set exactly when their canonical rows are equal. ``width`` must be at least the largest set's size."""
    rows = indices.reshape(indices.shape[0], -1).to(torch.int64)
    big = torch.iinfo(torch.int64).max
    ordered = torch.sort(torch.where(rows >= 0, rows, big), dim=-1).values
    repeated = torch.zeros_like(ordered, dtype=torch.bool)
    repeated[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    ordered = torch.sort(ordered.masked_fill(repeated, big), dim=-1).values
    if ordered.shape[1] < width:
        ordered = torch.cat([ordered, ordered.new_full((ordered.shape[0], width - ordered.shape[1]), big)], dim=1)
    if (ordered[:, width:] != big).any():
        raise ValueError(f"canonical_sets: a row holds more than width={width} distinct keys")
    return ordered[:, :width].masked_fill(ordered[:, :width] == big, -1)


def train_samples(record: Mapping[str, Any]) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``[(tokens, indices [len(tokens), k] relative to the sample's start)]`` of one train record, per sample in
    packing order (the padding segment after the samples is dropped). Refuses a record whose indices do not cover
    its packed sequence (a context-parallel shard)."""
    cu = [int(c) for c in record["cu_seqlens"]]
    tokens = [tuple(int(t) for t in sample) for sample in record["tokens"]]
    indices = torch.as_tensor(record["indices"])
    indices = indices.reshape(indices.shape[0], -1)
    if indices.shape[0] != cu[-1]:
        raise ValueError(f"train record of layer {record['layer']}: indices cover {indices.shape[0]} positions, its "
                         f"cu_seqlens {cu[-1]} (recorded on a context-parallel shard?): dump at "
                         "--context-parallel-size 1")
    if len(cu) - 1 < len(tokens):
        raise ValueError(f"train record of layer {record['layer']}: {len(tokens)} samples, {len(cu) - 1} segments")
    out = []
    for i, sample in enumerate(tokens):
        start, end = cu[i], cu[i + 1]
        if end - start != len(sample):
            raise ValueError(f"train record of layer {record['layer']}: sample {i} has {len(sample)} tokens, its "
                             f"segment {end - start}")
        rows = indices[start:end].to(torch.int64)
        out.append((sample, torch.where(rows >= 0, rows - start, rows)))
    return out


@dataclasses.dataclass
class LayerCount:
    """One layer's tally: query positions compared, and those whose sets differ (the first one, for the report)."""

    positions: int = 0
    differing: int = 0
    samples: int = 0
    first_difference: str | None = None


@dataclasses.dataclass
class IndexSetComparison:
    """Per layer, the train side's selections compared with the rollout side's. ``unmatched``: train samples with no
    rollout record of their tokens (nothing compared for them)."""

    layers: dict[int, LayerCount]
    train_samples: int
    unmatched: int

    @property
    def equal(self) -> bool:
        """Something was compared, and no set differed."""
        return bool(self.layers) and all(c.positions > 0 and c.differing == 0 for c in self.layers.values())

    def lines(self) -> list[str]:
        out = [f"{self.train_samples} train samples, {self.unmatched} without a rollout record of their tokens"]
        for layer, count in sorted(self.layers.items()):
            line = (f"layer {layer}: {count.positions} query positions in {count.samples} samples, "
                    f"{count.differing} with another key set")
            out.append(line + (f" (first: {count.first_difference})" if count.first_difference else ""))
        return out


def compare(train: Iterable[Mapping[str, Any]], rollout: Iterable[Mapping[str, Any]]) -> IndexSetComparison:
    """Each train record's samples against the rollout records of the same tokens (module docstring)."""
    by_tokens: dict[tuple[int, ...], list[Mapping[str, Any]]] = {}
    for record in rollout:
        by_tokens.setdefault(tuple(int(t) for t in record["tokens"]), []).append(record)
    layers: dict[int, LayerCount] = {}
    seen: set[tuple[int, ...]] = set()
    unmatched: set[tuple[int, ...]] = set()
    for record in train:
        layer = int(record["layer"])
        for tokens, indices in train_samples(record):
            seen.add(tokens)
            candidates = [r for r in by_tokens.get(tokens[:-1], ()) if layer in r["layers"]]
            if not candidates:
                unmatched.add(tokens)
                continue
            count = layers.setdefault(layer, LayerCount())
            count.samples += 1
            best: tuple[int, int, torch.Tensor] | None = None
            for candidate in candidates:
                start = int(candidate.get("start", 0))
                theirs = torch.as_tensor(candidate["layers"][layer]).reshape(len(tokens) - 1 - start, -1)
                ours = indices[start:len(tokens) - 1]
                width = max(ours.shape[1], theirs.shape[1])
                differ = (canonical_sets(ours, width) != canonical_sets(theirs, width)).any(dim=1)
                if best is None or int(differ.sum()) < best[0]:
                    best = (int(differ.sum()), start, differ)
            differing, start, differ = best
            count.positions += int(differ.numel())
            count.differing += differing
            if differing and count.first_difference is None:
                position = start + int(differ.nonzero()[0, 0])
                count.first_difference = f"position {position} of a {len(tokens)}-token sample"
    return IndexSetComparison(layers=layers, train_samples=len(seen), unmatched=len(unmatched))


RECORD_KEYS = {TRAIN_GLOB: ("layer", "cu_seqlens", "tokens", "indices"),
               ROLLOUT_GLOB: ("tokens", "start", "layers")}


def load_records(directory: str | Path, pattern: str) -> list[dict[str, Any]]:
    """The records of one side in ``directory`` (``train-*.pt`` or ``rollout-*.pt``), in name order. Each is opened
    only if it is a regular file (a FIFO, socket or device named like a record is refused, never waited on or read)
    and must be a record of that side (ValueError naming the file otherwise)."""
    from ..files import open_regular

    fix = "Fix: remove it from the directory (only the records a run wrote belong there)"
    records = []
    for path in sorted(Path(directory).glob(pattern)):
        try:
            f = open_regular(path)
        except ValueError as exc:  # a FIFO, socket, device or directory
            raise ValueError(f"{str(exc).rstrip('.')}. {fix}") from None
        with f:
            try:
                record = torch.load(f, weights_only=True)
            except Exception as exc:  # noqa: BLE001 - whatever torch cannot read, the file is not a record
                raise ValueError(f"{path}: not a record torch.save wrote ({type(exc).__name__}: "
                                 f"{' '.join(str(exc).split()).split('. ')[0][:160]}). {fix}") from None
        missing = [key for key in RECORD_KEYS[pattern] if not isinstance(record, Mapping) or key not in record]
        if missing:
            raise ValueError(f"{path}: not a {pattern} record (no {', '.join(missing)}). {fix}")
        records.append(record)
    return records


def compare_dirs(train_dir: str | Path, rollout_dir: str | Path) -> IndexSetComparison:
    """:func:`compare` of the records two sides wrote; refuses a directory without any."""
    train, rollout = load_records(train_dir, TRAIN_GLOB), load_records(rollout_dir, ROLLOUT_GLOB)
    for records, directory, pattern in ((train, train_dir, TRAIN_GLOB), (rollout, rollout_dir, ROLLOUT_GLOB)):
        if not records:
            raise ValueError(f"{directory}: no {pattern} records. Fix: pass the directory a run wrote them to "
                             "(the dsa-determinism plugin's ascend_dsa_index_dump_dir for the train side, serve-torch "
                             "--dump-dsa-index-sets for the rollout side)")
    return compare(train, rollout)


def as_lists(tokens: Sequence[torch.Tensor] | Sequence[Sequence[int]]) -> list[list[int]]:
    """Token ids as plain lists (what a record stores)."""
    return [torch.as_tensor(t).reshape(-1).tolist() for t in tokens]

"""Delta sync of quantised weights over slime's distributed transport (``update_weights_from_distributed``).

After a small training step most quantised blocks do not change. With a sync plugin's ``distributed_delta``
setting on, the train side keeps, per weight-update group, the last quantised version every engine of the group
acknowledged as serving, and pushes the next version bucket by bucket as the blocks of ``block_bytes`` bytes
that changed (:mod:`.quant_delta`: with 32 an MXFP8 weight's blocks are its OCP blocks; scales are diffed the
same way, so a changed block travels with its scale whenever the scale changed).

On the wire, a delta bucket is one ``/update_weights_from_distributed`` call and three broadcasts:

* ``load_format`` = ``"slime_ascend.quant_delta:<block_bytes>:<base version>:<base digest>"``: the digest
  (:func:`version_digest`, 32 hex digits: blake2b of each tensor's dtype, shape and bytes, over the names in order)
  of the base as the sender holds it, i.e. as every engine acknowledged serving it;
* ``names`` / ``dtypes`` / ``shapes``: every tensor of the bucket as a full push lists it (the engine checks them
  against the version it serves, as for a full bucket), then the three wire tensors :data:`WIRE_NAMES`:
  ``counts`` (int64, one per tensor: how many of its blocks changed, or -1: the tensor is sent whole, all its
  blocks, e.g. a name the base lacks), ``index`` (int64, the changed blocks' indices, tensor after tensor) and
  ``blocks`` (uint8 ``[n, block_bytes]``, their bytes; a tensor's last block zero-padded). Only these three are
  broadcast (an empty one is skipped on both sides).

The engine (:mod:`slime_ascend.rollout.torch_engine.weight_group`) applies the blocks into copies of the version
it serves and stages the result as a full bucket: the version serves only when all its buckets arrived and were
checked, with the same checks and atomic switch as a full push, byte-identical to it
(``tests/weight_sync/test_distributed_delta.py``). A delta against a version the engine does not serve is
refused (answer ``delta_refused``; the bytes are still taken, so the broadcast completes) and :class:`DeltaSender`
sends that bucket, and the rest of the version, in full. So is a delta whose base digest is not the digest of what
the engine serves under the base's label (an engine restarted from another checkpoint under that label, say):
applied, its blocks would have made a wrong tensor without an error. Both sides compute the digest once per version
(the sender as it sends the version, the engine at its first delta against it); it covers the whole version, so a
mismatch shows at the version's first delta bucket. The held copy is replaced only when every engine
answered that the version serves (``serving``); a push that breaks off leaves it at the version still serving.
An engine that does not answer ``serving`` (SGLang's server) never gets a delta: every version goes whole. With
several engines in a group, one refusal sends the version whole to all (an engine that staged the delta bucket
restarts the version from the full one).

Cost on the train side: one copy of the quantised model per group (rank 0), and a byte comparison of each bucket
with it. The runtime patch ``train.gloo_float8_broadcast`` calls :func:`push_bucket` for each bucket.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .quant_delta import _blocks
from .wire import wire_view

__all__ = ["BLOCK_BYTES", "DELTA_FORMAT", "WIRE_NAMES", "DeltaSender", "decode_delta", "delta_load_format",
           "encode_delta", "parse_delta_format", "push_bucket", "tensor_digest", "version_digest"]

logger = logging.getLogger("slime_ascend.weight_sync")

DELTA_FORMAT = "slime_ascend.quant_delta"
WIRE_NAMES = ("__quant_delta_counts__", "__quant_delta_index__", "__quant_delta_blocks__")
BLOCK_BYTES = 32  # an OCP MX block of e4m3 values


_DIGEST_HEX = 32


def delta_load_format(base_version: str, base_digest: str, block_bytes: int = BLOCK_BYTES) -> str:
    return f"{DELTA_FORMAT}:{int(block_bytes)}:{base_version}:{base_digest}"


def parse_delta_format(load_format: Any) -> tuple[int, str, str] | None:
    """``(block_bytes, base version, base digest)`` of a delta bucket's ``load_format``; None for anything else."""
    if not isinstance(load_format, str) or not load_format.startswith(DELTA_FORMAT + ":"):
        return None
    block, _, rest = load_format[len(DELTA_FORMAT) + 1:].partition(":")
    base, _, digest = rest.rpartition(":")
    if (not block.isdigit() or int(block) < 1 or not base or len(digest) != _DIGEST_HEX
            or digest.strip("0123456789abcdef")):
        raise ValueError(f"load_format={load_format[:200]!r}: expected '{DELTA_FORMAT}:<block_bytes>:<base version>:"
                         f"<base digest, {_DIGEST_HEX} hex digits>' (a sender without the base digest: update it)")
    return int(block), base, digest


def tensor_digest(t: torch.Tensor) -> bytes:
    """blake2b (16 bytes) of a tensor's dtype, shape and bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{str(t.dtype)[6:]}{list(t.shape)}".encode())
    if t.numel():
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.digest()


def version_digest(digests: Mapping[str, bytes]) -> str:
    """The digest of a version from its tensors' :func:`tensor_digest` (names in sorted order), hex."""
    h = hashlib.blake2b(digest_size=_DIGEST_HEX // 2)
    for name in sorted(digests):
        h.update(name.encode() + b"\0" + digests[name])
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- encoding
def _nblocks(t: torch.Tensor, block_bytes: int) -> int:
    return -(-t.numel() * t.element_size() // block_bytes)


def _changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Which rows (blocks) of two ``[n, block_bytes]`` uint8 tensors differ: compared 8 bytes at a time when the
    blocks allow it (8x fewer comparisons than byte by byte)."""
    if a.shape[1] % 8 == 0:
        try:
            return (a.view(torch.int64) != b.view(torch.int64)).any(dim=1)
        except RuntimeError:  # a storage offset that is not 8-byte aligned
            pass
    return (a != b).any(dim=1)


def encode_delta(held: Mapping[str, torch.Tensor], bucket: Sequence[tuple[str, torch.Tensor]],
                 block_bytes: int = BLOCK_BYTES) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(counts, index, blocks)`` of ``bucket`` against ``held`` (the version the engine serves)."""
    counts, index, blocks = [], [], []
    for name, t in bucket:
        prev = held.get(name)
        new = _blocks(t, block_bytes)
        if prev is None or prev.dtype != t.dtype or tuple(prev.shape) != tuple(t.shape):
            counts.append(-1)
            blocks.append(new)
            continue
        changed = _changed(_blocks(prev, block_bytes), new).nonzero().view(-1)
        counts.append(changed.numel())
        if changed.numel():
            index.append(changed)
            blocks.append(new.index_select(0, changed))
    return (torch.tensor(counts, dtype=torch.int64),
            torch.cat(index) if index else torch.empty(0, dtype=torch.int64),
            torch.cat(blocks) if blocks else torch.empty(0, block_bytes, dtype=torch.uint8))


def decode_delta(base: Mapping[str, torch.Tensor], entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                 counts: torch.Tensor, index: torch.Tensor, blocks: torch.Tensor,
                 block_bytes: int = BLOCK_BYTES) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors (new ones, ``base`` untouched): ``base``'s bytes with the changed blocks written over
    them. ValueError when the delta does not fit ``entries`` or ``base``."""
    if counts.numel() != len(entries):
        raise ValueError(f"the delta counts {counts.numel()} tensors, the bucket names {len(entries)}")
    out, at_index, at_block = [], 0, 0
    for (name, dtype, shape), count in zip(entries, counts.tolist(), strict=True):
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        nb = -(-nbytes // block_bytes)
        if count == -1:  # sent whole
            if at_block + nb > blocks.shape[0]:
                raise ValueError(f"{name}: the delta's blocks end before this tensor's {nb} blocks")
            raw = blocks[at_block:at_block + nb].reshape(-1)[:nbytes].clone()
            at_block += nb
        else:
            prev = base.get(name)
            if prev is None or prev.dtype != dtype or tuple(prev.shape) != tuple(shape):
                have = "absent" if prev is None else f"{prev.dtype} {tuple(prev.shape)}"
                raise ValueError(f"{name}: a delta against a tensor the base holds as {have}, not {dtype} {shape}")
            if count < 0 or at_index + count > index.numel() or at_block + count > blocks.shape[0]:
                raise ValueError(f"{name}: {count} changed blocks do not fit the delta's index/blocks")
            idx = index[at_index:at_index + count]
            if count and (int(idx.min()) < 0 or int(idx.max()) >= nb):
                raise ValueError(f"{name}: block indices outside its {nb} blocks")
            if count == 0:
                raw = None
            else:
                merged = _blocks(prev, block_bytes)
                merged = merged.clone() if merged.data_ptr() == prev.data_ptr() else merged
                merged.index_copy_(0, idx, blocks[at_block:at_block + count])
                raw = merged.reshape(-1)[:nbytes]
            at_index += count
            at_block += count
            if raw is None:  # unchanged: the base's tensor itself (tensors are never written in place)
                out.append((name, prev))
                continue
        out.append((name, raw.view(dtype).view(shape)))
    if at_index != index.numel() or at_block != blocks.shape[0]:
        raise ValueError(f"the delta carries {index.numel() - at_index} indices and {blocks.shape[0] - at_block} "
                         "blocks beyond its tensors")
    return out


# ---------------------------------------------------------------------------------------------- sender
def _send(engines: Sequence[Any], group: Any, group_name: str, version: str, names: list[str],
          dtypes: list[torch.dtype], shapes: list[Any], wire: list[torch.Tensor], load_format: str | None,
          backend: str, skip_empty: bool = False) -> list[Any]:
    """slime's order: every engine's call posted, then the broadcasts (``skip_empty``: a delta's empty wire
    tensors are not broadcast), waited for."""
    import torch.distributed as dist

    refs = [engine.update_weights_from_distributed.remote(names=names, dtypes=dtypes, shapes=shapes,
                                                          group_name=group_name, weight_version=version,
                                                          load_format=load_format)
            for engine in engines]
    handles = [dist.broadcast(wire_view(t, backend), 0, group=group, async_op=True) for t in wire
               if t.numel() or not skip_empty]
    for handle in handles:
        handle.wait()
    return refs


@dataclass
class _Version:
    version: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    full: bool = False  # this version goes whole (a delta was refused, or nothing is held)
    base: str | None = None  # the version its delta buckets were against
    sent: int = 0  # bytes broadcast for it (delta buckets: counts, indices and blocks)
    whole: int = 0  # bytes of its tensors
    digests: dict[str, bytes] = field(default_factory=dict)  # each tensor's tensor_digest, as sent
    digest: str | None = None  # version_digest, set once every engine serves it (held)


class DeltaSender:
    """Per process: the version each group's engines hold (as acknowledged) and the one being pushed."""

    def __init__(self, block_bytes: int = BLOCK_BYTES) -> None:
        self.block_bytes = block_bytes
        self._lock = threading.Lock()
        self.held: dict[str, _Version] = {}
        self._pending: dict[str, _Version] = {}
        self.last_density: float | None = None  # bytes of the last delta bucket over its full bytes

    def forget(self, group_name: str) -> None:
        with self._lock:
            self.held.pop(group_name, None)
            self._pending.pop(group_name, None)

    def push_bucket(self, group_name: str, group: Any, weight_version: Any, engines: Sequence[Any],
                    named: Sequence[tuple[str, torch.Tensor]], load_format: str | None = None,
                    get: Callable[[list[Any]], list[Any]] | None = None) -> list[Any]:
        """Send one bucket of ``weight_version`` (a delta when the group's engines hold a version), wait for the
        engines' answers (``get``: ``ray.get``) and return the refs of what was sent last."""
        import torch.distributed as dist

        if get is None:
            import ray

            get = ray.get
        version, backend = str(weight_version), dist.get_backend(group)
        named = [(n, t.detach().contiguous()) for n, t in named]
        with self._lock:
            pending = self._pending.get(group_name)
            if pending is None or pending.version != version:
                pending = self._pending[group_name] = _Version(version)
            held = self.held.get(group_name)
        names = [n for n, _ in named]
        dtypes, shapes = [t.dtype for _, t in named], [list(t.shape) for _, t in named]
        if held is not None and not pending.full and load_format is None and held.version != version:
            counts, index, blocks = encode_delta(held.tensors, named, self.block_bytes)
            refs = _send(engines, group, group_name, version, names + list(WIRE_NAMES),
                         dtypes + [torch.int64, torch.int64, torch.uint8],
                         shapes + [[counts.numel()], [index.numel()], list(blocks.shape)], [counts, index, blocks],
                         delta_load_format(held.version, held.digest, self.block_bytes), backend, skip_empty=True)
            answers = get(refs)
            refused = [a.get("message") for a in answers if not (isinstance(a, dict) and a.get("success", True))]
            if not refused:
                full = sum(t.numel() * t.element_size() for _, t in named)
                sent = counts.numel() * 8 + index.numel() * 8 + blocks.numel()
                self.last_density = sent / max(1, full)
                pending.base = held.version
                self._received(group_name, pending, named, answers, sent)
                return refs
            logger.warning("weight version %s: a delta against version %s was refused (%s); sending this version "
                           "whole", version, held.version, refused[0])
            pending.full = True
        refs = _send(engines, group, group_name, version, names, dtypes, shapes, [t for _, t in named],
                     load_format, backend)
        self._received(group_name, pending, named, get(refs))
        return refs

    def _received(self, group_name: str, pending: _Version, named: Sequence[tuple[str, torch.Tensor]],
                  answers: list[Any], sent: int | None = None) -> None:
        pending.tensors.update((n, t.clone()) for n, t in named)  # the bytes sent (a view of a param changes)
        pending.digests.update((n, tensor_digest(pending.tensors[n])) for n, _ in named)
        whole = sum(t.numel() * t.element_size() for _, t in named)
        pending.whole += whole
        pending.sent += whole if sent is None else sent
        if answers and all(isinstance(a, dict) and a.get("serving") and a.get("weight_version") == pending.version
                           for a in answers):
            logger.info("weight version %s serving on group %s (%d engines): %s, %d of its %d bytes broadcast "
                        "(density %.4f)", pending.version, group_name, len(answers),
                        "whole" if pending.base is None else f"delta against version {pending.base}",
                        pending.sent, pending.whole, pending.sent / max(1, pending.whole))
            pending.digest = version_digest(pending.digests)  # what a delta against it carries
            with self._lock:
                self.held[group_name] = pending
                if self._pending.get(group_name) is pending:
                    del self._pending[group_name]


_SENDER = DeltaSender()


def push_bucket(group_name: str, group: Any, weight_version: Any, engines: Sequence[Any],
                named: Sequence[tuple[str, torch.Tensor]], load_format: str | None = None, *, delta: bool,
                get: Callable[[list[Any]], list[Any]] | None = None) -> list[Any]:
    """One bucket of slime's ``update_weights_from_distributed``: with ``delta`` through this process's
    :class:`DeltaSender`; without, exactly slime's push (float8 as its bytes over gloo)."""
    if delta:
        return _SENDER.push_bucket(group_name, group, weight_version, engines, named, load_format, get)
    import torch.distributed as dist

    return _send(engines, group, group_name, str(weight_version), [n for n, _ in named],
                 [t.dtype for _, t in named], [t.shape for _, t in named], [t.data for _, t in named], load_format,
                 dist.get_backend(group))

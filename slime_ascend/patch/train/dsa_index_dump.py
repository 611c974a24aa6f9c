"""slime's GLM-5 attention writes the DSA key sets it read (the ``dsa-determinism`` plugin's
``ascend_dsa_index_dump_dir``, off by default).

slime's ``DSAMultiLatentAttention.forward`` (``slime_plugins/models/glm5/glm5.py``) selects each query's keys with
the lightning indexer (computing layers) or takes them from the IndexShare holder (skip layers) and hands them to
``SparseMLA.apply(q, kv, topk_indices, softmax_scale)`` (``SGLangSparseMLA.apply`` with
``MEGATRON_USE_SGLANG_SPARSE_MLA=1``); the indices are local to the forward and nothing records them, so whether
the train side attends to the keys the rollout side attended to cannot be read off a run. This patch writes, for
every call of either on one packed micro-batch, the train record of :mod:`slime_ascend.dsa.index_sets`: the layer
(``layer_number - 1``), the micro-batch's ``cu_seqlens_q``, its samples' tokens and the indices as attended to.

How: three wrappers, nothing else changed (the attention's inputs and outputs are the same objects):

* ``model.get_batch`` (slime's ``model.py`` imports it by name): the batch's ``unconcat_tokens`` (each sample's
  tokens) kept by its ``packed_seq_params`` object while it lives (no attribute is set on it);
* ``DSAMultiLatentAttention.forward``: its layer number and ``packed_seq_params`` in a context variable for the call;
* ``glm5.SparseMLA`` / ``glm5.SGLangSparseMLA`` (looked up by name at each call): an object whose ``apply`` writes
  the record, then calls the original's.

Each rank writes its own files, ``train-rank<R>-<pid>-<n>.pt``; activation recompute writes a call twice (the same
sets). Context parallelism is refused at ``parse_args`` (a CP rank holds a shard of each sequence's queries).

Upstream: patches/0026-glm5-dsa-index-dump.patch (the same record behind a ``--save-debug-dsa-index-dir`` flag).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import itertools
import os
import weakref
from pathlib import Path
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source

GLM5 = "slime_plugins.models.glm5.glm5"
MODEL = "slime.backends.megatron_utils.model"
ATTENTION = "DSAMultiLatentAttention"
SPARSE = ("SparseMLA", "SGLangSparseMLA")
FORWARD_SNIPPETS = ("SparseMLA.apply(q, kv, topk_indices, self.softmax_scale)", "SGLangSparseMLA.apply(",
                    "topk_indices,", "packed_seq_params.cu_seqlens_q")

_CALL: contextvars.ContextVar[tuple[int, Any] | None] = contextvars.ContextVar("slime_ascend_dsa_layer", default=None)


def wanted(args: Any) -> bool:
    """The ``dsa-determinism`` plugin's ``ascend_dsa_index_dump_dir`` is set."""
    from slime_ascend.dsa.plugin import index_dump_dir

    return index_dump_dir(args) is not None


class IndexSetWriter:
    """Writes one rank's train records into ``directory``."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._count = itertools.count()
        # each live packed_seq_params' sample tokens, by id (the object is an unhashable dataclass): an entry goes
        # with its object
        self._tokens: dict[int, list[list[int]]] = {}

    def remember_batch(self, batch: Any) -> None:
        params = batch.get("packed_seq_params") if isinstance(batch, dict) else None
        if params is not None and batch.get("unconcat_tokens") is not None:
            from slime_ascend.dsa.index_sets import as_lists

            key = id(params)
            self._tokens[key] = as_lists(batch["unconcat_tokens"])
            weakref.finalize(params, self._tokens.pop, key, None)

    def write(self, layer_number: int, params: Any, topk_indices: Any) -> None:
        import torch
        import torch.distributed as dist

        indices = topk_indices.detach()
        record = {
            "layer": int(layer_number) - 1,
            "cu_seqlens": [int(c) for c in params.cu_seqlens_q.tolist()],
            "tokens": self._tokens.get(id(params), []),
            "indices": indices.reshape(indices.shape[0], -1).to(torch.int32).cpu(),
        }
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        torch.save(record, self.directory / f"train-rank{rank:04d}-{os.getpid()}-{next(self._count):06d}.pt")


class _RecordingSparseMLA:
    """Stands for one of glm5.py's sparse-attention Functions: ``apply`` writes the record of the layer in progress,
    then calls the Function's own; any other attribute is the Function's."""

    def __init__(self, function: Any, writer: IndexSetWriter):
        self.__wrapped__ = function
        self._writer = writer

    def apply(self, q, kv, topk_indices, *args, **kwargs):
        call = _CALL.get()
        if call is not None and call[1] is not None:
            self._writer.write(call[0], call[1], topk_indices)
        return self.__wrapped__.apply(q, kv, topk_indices, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)


def _forward_in_context(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs)
        token = _CALL.set((int(self.layer_number), bound.arguments.get("packed_seq_params")))
        try:
            return original(self, *args, **kwargs)
        finally:
            _CALL.reset(token)

    return forward


def _get_batch_remembered(original, writer: IndexSetWriter):
    @functools.wraps(original)
    def get_batch(*args, **kwargs):
        batch = original(*args, **kwargs)
        writer.remember_batch(batch)
        return batch

    return get_batch


class DSAIndexDump(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        glm5, model = modules[GLM5], modules[MODEL]
        problems = missing_attrs(glm5, [f"{ATTENTION}.forward", *SPARSE]) + missing_attrs(model, ["get_batch"])
        if problems:
            return problems
        forward = inspect.unwrap(getattr(glm5, ATTENTION).forward)
        if "packed_seq_params" not in inspect.signature(forward).parameters:
            problems.append(f"{GLM5}.{ATTENTION}.forward has no packed_seq_params parameter")
        problems += missing_source(forward, FORWARD_SNIPPETS, f"{ATTENTION}.forward")
        problems += missing_source(inspect.unwrap(model.get_batch), ['batch["unconcat_tokens"] = tokens'],
                                   f"{MODEL}.get_batch")
        for name in SPARSE:
            if not callable(getattr(getattr(glm5, name), "apply", None)):
                problems.append(f"{GLM5}.{name} has no apply")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        glm5, model = modules[GLM5], modules[MODEL]
        from slime_ascend.dsa.plugin import index_dump_dir

        writer = IndexSetWriter(index_dump_dir(args))
        self.wrap(model, "get_batch", lambda original: _get_batch_remembered(original, writer))
        self.wrap(getattr(glm5, ATTENTION), "forward", _forward_in_context)
        for name in SPARSE:
            self.wrap(glm5, name, lambda original: _RecordingSparseMLA(original, writer))


PATCH = DSAIndexDump(
    id="train.dsa_index_dump",
    targets=(f"{GLM5}:{ATTENTION}.forward", *(f"{GLM5}:{n}" for n in SPARSE), f"{MODEL}:get_batch"),
    why="slime's GLM-5 attention keeps the DSA key sets it selected local to its forward: whether the train side "
        "attends to the keys the rollout engine attended to (the dsa-determinism contract, IndexShare layers "
        "included) cannot be read off a run.",
    how="With ascend_dsa_index_dump_dir set: wrap model.get_batch to keep each micro-batch's sample tokens by its "
        "packed_seq_params while it lives, DSAMultiLatentAttention.forward to hold its layer number and "
        "packed_seq_params "
        "in a context variable, and glm5.SparseMLA / SGLangSparseMLA with an object whose apply writes "
        "(layer, cu_seqlens, tokens, topk_indices) per call before calling the original's.",
    upstream="patches/0026-glm5-dsa-index-dump.patch",
    checked_on=("0.3.1",),
)

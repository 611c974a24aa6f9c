"""The loss batch also holds each sample's forwarded ``metadata`` (``Sample.train_metadata``).

The ``opd`` plugin's top-k mode reads ``train_metadata["opd_topk"]`` there. ``model.py`` imports ``get_batch``
by name from ``.data``; the log-prob passes of ``forward_only`` (their keys hold no ``advantages``) are left alone.
The data iterator returns the micro-batch's dicts in batch order (``None`` when nothing was forwarded); nothing
else in the batch changes. Values are as produced, one per sample, not sliced for context parallelism (the same
contract as ``--extra-train-batch-keys`` in the upstream patch).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source, param_mismatch

MODEL = "slime.backends.megatron_utils.model"
DATA = "slime.backends.megatron_utils.data"
KEY = "metadata"
#: A key only the loss batch's request holds (train_one_step), not forward_only's log-prob passes.
LOSS_BATCH_MARKER = "advantages"


def _wrap_get_batch(original):
    @functools.wraps(original)
    def get_batch(data_iterator, keys, *rest, **kwargs):
        if LOSS_BATCH_MARKER in keys and KEY not in keys:
            keys = [*keys, KEY]
        return original(data_iterator, keys, *rest, **kwargs)

    return get_batch


class LossBatchMetadata(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        model = modules[MODEL]
        data = importlib.import_module(DATA)  # read only: the iterator that answers the wider request
        problems = missing_attrs(model, ["get_batch", "train_one_step"]) + missing_attrs(data, ["DataIterator"])
        if problems:
            return problems
        problems += param_mismatch(model.get_batch, ["data_iterator", "keys"], "get_batch")
        problems += missing_source(model.train_one_step, ["batch = get_batch(", '"advantages"', '"teacher_log_probs"'],
                                   "train_one_step")
        problems += param_mismatch(data.DataIterator.get_next, ["self", "keys"], "DataIterator.get_next")
        problems += missing_source(data.DataIterator.get_next, ["self.rollout_data.get(key, None)"],
                                   "DataIterator.get_next")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        self.wrap(modules[MODEL], "get_batch", _wrap_get_batch)


PATCH = LossBatchMetadata(
    id="train.loss_batch_metadata",
    targets=(f"{MODEL}:get_batch",),
    why="train_one_step fetches a fixed list of keys into the loss batch, so a custom loss cannot read the "
    "forwarded per-sample metadata of its micro-batch (OPD top-k: the teacher's top-k ids and log-probs).",
    how="Wrap model.get_batch: the loss batch's key list (the one holding 'advantages') also asks the data "
    "iterator for 'metadata'.",
    upstream="patches/0004-forward-metadata-extra-batch-keys.patch",
    checked_on=("0.3.1",),
)

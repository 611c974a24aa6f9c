"""slime's distributed weight push with one bucket in flight while the next is made (a sync plugin's
``pipelined_send`` setting, off by default).

``UpdateWeightFromDistributed._send_weights`` makes each bucket (gather, ``convert_to_hf``: with ``fp8-sync`` /
``int8-sync`` / ``int4-sync`` / ``mxfp8-sync`` the quantisation) and hands it to
``_update_bucket_weights_from_distributed``, which takes slime's engine lock, posts the engines' calls,
broadcasts, waits for the broadcast and the engines' answers, and releases the lock, before the next bucket is
made. Quantising is then on the push's critical path: measured on this host it costs about as much as the whole
bf16 push (``benchmarks/bench_weight_sync.py``).

This patch changes only where that wait happens, and only in slime's own ``UpdateWeightFromDistributed`` (a
subclass, e.g. the disk-delta updater, is untouched):

* ``_update_bucket_weights_from_distributed`` hands slime's own method (lock, calls, broadcasts, waits, unlock,
  progress bar: unchanged, with every patch on ``update_weights_from_distributed``, the delta push included) to
  one sender thread and returns, after waiting for the bucket before it: the broadcast of bucket k overlaps the
  making of bucket k+1 on the caller's thread
  (:class:`slime_ascend.weight_sync.pipelined_send.BucketPipeline`);
* ``_send_weights`` runs slime's own loop and then waits for the last bucket; on a failure it waits for the bucket
  in flight (which releases the lock) and raises the failure.

The engines still get the buckets one at a time, in order, each checked and the version switched only when all
have arrived; a delta bucket (``distributed_delta``) sees the answers to the one before it, as before.

Measured (``benchmarks/bench_weight_sync.py``, the same pipeline on its transport): on the 2-core CPU host the
overlapped push is within noise of slime's order (0.9-1.1x), since the receiver and gloo share the two cores with
the quantisation. The overlap is for hosts where the broadcast runs on a link (NCCL/HCCL) while the device
quantises; not measured there, hence off by default. Upstream:
``patches/0025-pipelined-distributed-weight-send.patch``.
"""

from __future__ import annotations

import functools
import weakref
from types import ModuleType
from typing import Any

from ..base import RuntimePatch, missing_attrs, missing_source, param_mismatch

MODULE = "slime.backends.megatron_utils.update_weight.update_weight_from_distributed"
CLASS = "UpdateWeightFromDistributed"
SEND_SNIPPETS = ("for chunk_iter in (self._iter_non_expert_chunks(), self._iter_expert_chunks()):",
                 "self._update_bucket_weights_from_distributed(hf_chunk, pbar=pbar)",
                 "dist.barrier(group=get_gloo_group())")
BUCKET_SNIPPETS = ("while not ray.get(self.rollout_engine_lock.acquire.remote()):",
                   "refs = update_weights_from_distributed(", "self._group_name,", "self._model_update_groups,",
                   "self.weight_version,", "self.rollout_engines,", "ray.get(refs)",
                   "converted_named_tensors.clear()", "ray.get(self.rollout_engine_lock.release.remote())",
                   "pbar.update(1)")

# the pipeline of each _send_weights in progress, by updater (no attribute is set on slime's object)
_PIPELINES: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def wanted(args: Any) -> bool:
    """A sync plugin's ``pipelined_send`` is on."""
    from slime_ascend.weight_sync.funnel import pipelined_send_enabled

    return pipelined_send_enabled(args)


def _wrap_send(module: ModuleType):
    def wrapper(original):
        @functools.wraps(original)
        def _send_weights(self, pbar):
            if type(self) is not getattr(module, CLASS):  # a subclass's push: slime's own behaviour
                return original(self, pbar)
            from slime_ascend.weight_sync.pipelined_send import BucketPipeline

            pipeline = _PIPELINES[self] = BucketPipeline()
            try:
                original(self, pbar)
            except BaseException:
                pipeline.drain_after_failure()  # the bucket in flight ends (and releases slime's lock) first
                raise
            else:
                pipeline.drain()
            finally:
                _PIPELINES.pop(self, None)
                pipeline.close()

        return _send_weights

    return wrapper


def _wrap_bucket(original):
    @functools.wraps(original)
    def _update_bucket_weights_from_distributed(self, converted_named_tensors, pbar=None, load_format=None):
        pipeline = _PIPELINES.get(self)
        if pipeline is None:
            return original(self, converted_named_tensors, pbar=pbar, load_format=load_format)
        # slime's own bucket send on the pipeline's thread, once the bucket before it has been sent
        pipeline.submit(original, self, converted_named_tensors, pbar=pbar, load_format=load_format)

    return _update_bucket_weights_from_distributed


class PipelinedWeightSend(RuntimePatch):
    def check(self, modules: dict[str, ModuleType]) -> list[str]:
        module = modules[MODULE]
        problems = missing_attrs(module, [f"{CLASS}._send_weights", f"{CLASS}._update_bucket_weights_from_distributed",
                                          "update_weights_from_distributed", "get_gloo_group"])
        if problems:
            return problems
        cls = getattr(module, CLASS)
        problems += param_mismatch(cls._send_weights, ["self", "pbar"], f"{CLASS}._send_weights")
        problems += missing_source(cls._send_weights, SEND_SNIPPETS, f"{CLASS}._send_weights")
        bucket = cls._update_bucket_weights_from_distributed
        problems += param_mismatch(bucket, ["self", "converted_named_tensors", "pbar", "load_format"],
                                   f"{CLASS}._update_bucket_weights_from_distributed")
        problems += missing_source(bucket, BUCKET_SNIPPETS, f"{CLASS}._update_bucket_weights_from_distributed")
        return problems

    def apply(self, modules: dict[str, ModuleType], args: Any = None) -> None:
        module = modules[MODULE]
        cls = getattr(module, CLASS)
        self.wrap(cls, "_send_weights", _wrap_send(module))
        self.wrap(cls, "_update_bucket_weights_from_distributed", _wrap_bucket)


PATCH = PipelinedWeightSend(
    id="train.pipelined_weight_send",
    targets=(f"{MODULE}:{CLASS}._send_weights", f"{MODULE}:{CLASS}._update_bucket_weights_from_distributed"),
    why="slime waits for each bucket's broadcast and the engines' answers before making the next bucket, so a "
        "quantised push pays its quantisation on top of the transfer (about the cost of the whole bf16 push).",
    how="slime's own _update_bucket_weights_from_distributed runs on one sender thread, waited for when the next "
        "bucket is handed over or the pass ends: one bucket in flight while the next is gathered and quantised; "
        "slime's UpdateWeightFromDistributed only.",
    upstream="patches/0025-pipelined-distributed-weight-send.patch",
    checked_on=("0.3.1",),
)

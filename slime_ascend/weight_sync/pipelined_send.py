"""One weight-push bucket in flight while the next is made: the broadcast of bucket k overlaps the gather,
conversion and quantisation of bucket k+1.

slime's distributed push (``UpdateWeightFromDistributed._send_weights``) makes a bucket (TP/EP gather,
``convert_to_hf``, and with a sync plugin the quantisation), then sends it and waits for every engine to take it,
then makes the next: the sender's device and the link idle in turn. With :class:`BucketPipeline`, a bucket's send is
handed to one sender thread (where slime's own bucket send runs: lock, the engines' calls, the broadcasts, the
waits, unlock) and waited for only when the next bucket is ready to be sent, or at the end of a pass. So at most one
bucket is in flight, and the engines take the buckets in order, one at a time, as before; the sender holds one more
bucket in memory (``--update-weight-buffer-size`` bounds each).

Ordering: the broadcast of bucket k runs on the weight-update group (train rank 0 and the engines) while rank 0
takes part in the TP/EP gathers of bucket k+1 (train ranks only); the two groups share rank 0 alone and each sees
its collectives in the same order on every member, so neither waits on the other.

Pure: no slime, Ray or torch.distributed here; the runtime patch ``train.pipelined_weight_send`` hands slime's own
bucket send to :class:`BucketPipeline`, and ``benchmarks/bench_weight_sync.py`` measures the same class on its
transport.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

logger = logging.getLogger("slime_ascend.weight_sync")


class BucketPipeline:
    """At most one bucket's send in flight, on one sender thread of its own. :meth:`submit` waits for the send in
    flight (raising what it raised), then starts the next; :meth:`drain` waits for the last; :meth:`close` stops the
    thread."""

    def __init__(self) -> None:
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slime-ascend-weight-send")
        self._in_flight: Future | None = None

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def submit(self, send: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Wait for the send in flight, then run ``send(*args, **kwargs)`` on the sender thread."""
        self.drain()
        self._in_flight = self._sender.submit(send, *args, **kwargs)

    def drain(self) -> None:
        """Wait for the send in flight, if any (one that raises leaves none in flight)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()

    def drain_after_failure(self) -> None:
        """After a failure on the caller's side: wait for the send in flight (so that it ends, e.g. releases a lock),
        logging rather than raising what it raises (the caller's failure is the one to report)."""
        try:
            self.drain()
        except BaseException:  # noqa: BLE001 - the caller re-raises its own failure
            logger.exception("the weight bucket in flight failed too")

    def close(self) -> None:
        self._sender.shutdown(wait=True)

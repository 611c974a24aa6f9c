"""One weight-push bucket in flight while the next is made: the broadcast of bucket k overlaps the gather,
conversion and quantisation of bucket k+1.

slime's distributed push (``UpdateWeightFromDistributed._send_weights``) makes a bucket (TP/EP gather,
``convert_to_hf``, and with a sync plugin the quantisation), then sends it and waits for every engine to take it,
then makes the next: the sender's device and the link idle in turn. With :class:`BucketPipeline`, a bucket's
send is *started* (with :class:`ThreadedBucketPipeline`: handed to one sender thread, where slime's own bucket send
runs: lock, the engines' calls, the broadcasts, the waits, unlock) and *finished* (waited for) only when the next
bucket is ready to start, or at the end of a pass. So at most one bucket is in flight, and the engines take the
buckets in order, one at a time, as before; the sender holds one more bucket in memory
(``--update-weight-buffer-size`` bounds each).

Ordering: the broadcast of bucket k runs on the weight-update group (train rank 0 and the engines) while rank 0
takes part in the TP/EP gathers of bucket k+1 (train ranks only); the two groups share rank 0 alone and each sees
its collectives in the same order on every member, so neither waits on the other.

Pure: no slime, Ray or torch.distributed here; the runtime patch ``train.pipelined_weight_send`` hands slime's own
bucket send to :class:`ThreadedBucketPipeline`, and ``benchmarks/bench_weight_sync.py`` measures the same class on
its transport.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

Finish = Callable[[], None]


class BucketPipeline:
    """At most one started, unfinished bucket. :meth:`submit` finishes the one in flight, then starts the next;
    :meth:`drain` finishes the last. A failure while one is in flight: :meth:`abandon` runs its ``on_abandon``
    (e.g. releases a lock) without waiting for it."""

    def __init__(self) -> None:
        self._finish: Finish | None = None
        self._abandon: Finish | None = None
        self.started = 0
        self.finished = 0

    @property
    def in_flight(self) -> bool:
        return self._finish is not None

    def submit(self, start: Callable[[], tuple[Finish, Finish | None]]) -> None:
        """Finish the bucket in flight, then ``start()`` the next; ``start`` returns (its finish, its abandon)."""
        self.drain()
        finish, abandon = start()
        self._finish, self._abandon = finish, abandon
        self.started += 1

    def drain(self) -> None:
        """Finish the bucket in flight, if any (its finish raising leaves none in flight)."""
        finish, self._finish, self._abandon = self._finish, None, None
        if finish is not None:
            finish()
            self.finished += 1

    def abandon(self) -> None:
        """Forget the bucket in flight without waiting for it; run its abandon callback, if any."""
        abandon, self._finish, self._abandon = self._abandon, None, None
        if abandon is not None:
            abandon()


class ThreadedBucketPipeline(BucketPipeline):
    """A :class:`BucketPipeline` whose buckets are sent on one thread of its own (:attr:`sender`): a bucket's start
    submits its send there, its finish waits for that send (and raises what it raised)."""

    def __init__(self) -> None:
        super().__init__()
        self.sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slime-ascend-weight-send")

    def drain_after_failure(self) -> None:
        """After a failure on the caller's side: wait for the bucket in flight (so that it ends, e.g. releases a
        lock), logging rather than raising what it raises (the caller's failure is the one to report)."""
        import logging

        try:
            self.drain()
        except BaseException:  # noqa: BLE001 - the caller re-raises its own failure
            logging.getLogger("slime_ascend.weight_sync").exception("the weight bucket in flight failed too")

    def close(self) -> None:
        self.sender.shutdown(wait=True)

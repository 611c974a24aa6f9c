"""weight_sync.pipelined_send: at most one bucket in flight on the sender thread, finished before the next starts
and at the end; a failed send reaches the caller."""

from __future__ import annotations

import threading
import time

import pytest

from slime_ascend.weight_sync.pipelined_send import BucketPipeline


def test_one_bucket_in_flight_finished_before_the_next_starts():
    """Bucket k+1 is made while the send of bucket k is still in flight (that send cannot end before it is made),
    and each send ends before the next begins; after :meth:`drain` nothing is in flight."""
    log: list[str] = []
    started, released = ([threading.Event() for _ in range(3)] for _ in range(2))
    pipeline = BucketPipeline()

    def send(k):
        log.append(f"start {k}")
        started[k].set()
        assert released[k].wait(5)
        log.append(f"finish {k}")

    try:
        for k in range(3):
            if k:
                assert started[k - 1].wait(5)  # the send before is in flight
            log.append(f"make {k}")
            if k:
                released[k - 1].set()  # the send before may end only now: bucket k is made
            pipeline.submit(send, k)
            assert pipeline.in_flight
        released[2].set()
        pipeline.drain()
    finally:
        pipeline.close()
    assert log == ["make 0", "start 0", "make 1", "finish 0", "start 1", "make 2", "finish 1", "start 2", "finish 2"]
    assert not pipeline.in_flight


def test_the_threaded_send_overlaps_the_making_of_the_next_bucket_and_keeps_the_order():
    """The send of bucket k runs while the caller makes bucket k+1 (the caller's work starts before the send
    ends), and the sends run one at a time, in order."""
    events: list[tuple[str, int, float]] = []
    lock = threading.Lock()
    pipeline = BucketPipeline()

    def send(k):
        with lock:
            events.append(("send start", k, time.monotonic()))
        time.sleep(0.05)
        with lock:
            events.append(("send end", k, time.monotonic()))

    try:
        for k in range(4):
            with lock:
                events.append(("make", k, time.monotonic()))
            time.sleep(0.01)
            pipeline.submit(send, k)
        pipeline.drain()
    finally:
        pipeline.close()
    sends = [(kind, k) for kind, k, _ in events if kind.startswith("send")]
    assert sends == [(kind, k) for k in range(4) for kind in ("send start", "send end")]  # one at a time, in order
    at = {(kind, k): t for kind, k, t in events}
    assert all(at[("make", k + 1)] < at[("send end", k)] for k in range(3))  # the overlap


def test_a_failed_send_is_raised_to_the_caller_and_after_a_caller_failure_only_logged(caplog):
    pipeline = BucketPipeline()

    def boom():
        raise RuntimeError("engine gone")

    try:
        pipeline.submit(boom)
        with pytest.raises(RuntimeError, match="engine gone"):
            pipeline.drain()
        assert not pipeline.in_flight
        pipeline.submit(boom)
        pipeline.drain_after_failure()  # the caller's own failure is the one it raises
        assert "the weight bucket in flight failed too" in caplog.text and not pipeline.in_flight
    finally:
        pipeline.close()

"""weight_sync.pipelined_send: at most one bucket in flight, finished before the next starts and at the end; a
threaded bucket's failure reaches the caller."""

from __future__ import annotations

import threading
import time

import pytest

from slime_ascend.weight_sync.pipelined_send import BucketPipeline, ThreadedBucketPipeline


def test_one_bucket_in_flight_finished_before_the_next_starts():
    log: list[str] = []
    pipeline = BucketPipeline()

    def start(k):
        log.append(f"start {k}")
        return (lambda: log.append(f"finish {k}")), (lambda: log.append(f"abandon {k}"))

    for k in range(3):
        log.append(f"make {k}")
        pipeline.submit(lambda k=k: start(k))
    assert pipeline.in_flight
    pipeline.drain()
    assert log == ["make 0", "start 0", "make 1", "finish 0", "start 1", "make 2", "finish 1", "start 2", "finish 2"]
    assert (pipeline.started, pipeline.finished, pipeline.in_flight) == (3, 3, False)
    pipeline.submit(lambda: start(3))
    pipeline.abandon()
    assert log[-2:] == ["start 3", "abandon 3"] and not pipeline.in_flight
    pipeline.drain()  # nothing in flight: nothing happens
    assert log[-1] == "abandon 3"


def test_the_threaded_send_overlaps_the_making_of_the_next_bucket_and_keeps_the_order():
    """The send of bucket k runs while the caller makes bucket k+1 (the caller's work starts before the send
    ends), and the sends run one at a time, in order."""
    events: list[tuple[str, int, float]] = []
    lock = threading.Lock()
    pipeline = ThreadedBucketPipeline()

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
            pipeline.submit(lambda k=k: (pipeline.sender.submit(send, k).result, None))
        pipeline.drain()
    finally:
        pipeline.close()
    sends = [(kind, k) for kind, k, _ in events if kind.startswith("send")]
    assert sends == [(kind, k) for k in range(4) for kind in ("send start", "send end")]  # one at a time, in order
    at = {(kind, k): t for kind, k, t in events}
    assert all(at[("make", k + 1)] < at[("send end", k)] for k in range(3))  # the overlap


def test_a_failed_send_is_raised_to_the_caller_and_after_a_caller_failure_only_logged(caplog):
    pipeline = ThreadedBucketPipeline()

    def boom():
        raise RuntimeError("engine gone")

    try:
        pipeline.submit(lambda: (pipeline.sender.submit(boom).result, None))
        with pytest.raises(RuntimeError, match="engine gone"):
            pipeline.drain()
        assert not pipeline.in_flight
        pipeline.submit(lambda: (pipeline.sender.submit(boom).result, None))
        pipeline.drain_after_failure()  # the caller's own failure is the one it raises
        assert "the weight bucket in flight failed too" in caplog.text and not pipeline.in_flight
    finally:
        pipeline.close()

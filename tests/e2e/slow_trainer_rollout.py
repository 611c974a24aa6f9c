"""slime's fully-async rollout, with the trainer made reliably slower than the engine.

A ``--rollout-function-path`` for the e2e tests (the RolloutManager imports it: the test puts this
folder on the job's PYTHONPATH). It calls slime's own ``generate_rollout_fully_async`` unchanged, then,
before handing the rollout back, waits until slime's worker is at rest: every group it took from the
data buffer is finished, and its queue of finished groups is full, so it starts no more.

Why: ``train_async.py`` updates the weights right after the next rollout returns. Whether the groups
the worker generates ahead are finished with the old weights before that update depends on how long
the train step takes against the engine: on a busy 2-core host the update can overtake them, and no
group is ever stale. A real trainer (seconds to minutes a step) is always the slow side; waiting here
makes that the case on any host, so a staleness test can count on stale groups existing.

How many groups are ahead is still the worker's choice: it tops its pool up once a second, so a group
that finishes while another still runs makes room for a third before the queue is full (2 or 3 with a
pool of 2). The helper prints the number (``AHEAD_LINE``) so a test can expect exactly that many.

The worker is handed a counting view of slime's data buffer (``_CountingBuffer``: every call passes
through) so that "every group it took is finished" can be told: taken - given back - delivered -
queued = running.
"""
from __future__ import annotations

import time

from slime.rollout import fully_async_rollout

AHEAD_TIMEOUT_S = 300.0
AHEAD_LINE = "slow_trainer_rollout: groups finished ahead of the weight update after rollout {rollout_id}: {ahead}"


class _CountingBuffer:
    """slime's data buffer, counting the groups the worker takes and gives back (aborted ones)."""

    def __init__(self, buffer):
        self._buffer = buffer
        self.taken = 0
        self.given_back = 0

    def get_samples(self, num_samples):
        groups = self._buffer.get_samples(num_samples)
        self.taken += len(groups)
        return groups

    def add_samples(self, groups):
        self.given_back += len(groups)
        return self._buffer.add_samples(groups)

    def __getattr__(self, name):
        return getattr(self._buffer, name)


_counting: _CountingBuffer | None = None
_delivered = 0


def generate_rollout(args, rollout_id, data_buffer, evaluation: bool = False):
    global _counting, _delivered
    if _counting is None:
        _counting = _CountingBuffer(data_buffer)
    out = fully_async_rollout.generate_rollout_fully_async(args, rollout_id, _counting, evaluation)
    _delivered += len(out)
    if rollout_id + 1 < args.num_rollout:  # a weight update follows
        worker = fully_async_rollout._global_worker
        deadline = time.monotonic() + AHEAD_TIMEOUT_S
        while True:
            queued = worker.queue_size()
            running = _counting.taken - _counting.given_back - _delivered - queued
            if running == 0 and queued >= worker.concurrency:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"slime's fully-async worker did not come to rest in {AHEAD_TIMEOUT_S:.0f} s "
                                   f"({queued} groups queued, {running} running, pool {worker.concurrency})")
            time.sleep(0.05)
        print(AHEAD_LINE.format(rollout_id=rollout_id, ahead=queued), flush=True)
    return out

"""slime's fully-async rollout, with the trainer made reliably slower than the engine.

A ``--rollout-function-path`` for the e2e tests (the RolloutManager imports it: the test puts this
folder on the job's PYTHONPATH). It calls slime's own ``generate_rollout_fully_async`` unchanged, then,
before handing the rollout back, waits until slime's worker has *finished* the groups it keeps ahead
of the trainer (its queue holds ``concurrency`` groups).

Why: ``train_async.py`` updates the weights right after the next rollout returns. Whether the groups
the worker generates ahead are finished with the old weights before that update depends on how long
the train step takes against the engine: on a busy 2-core host the update can overtake them, and no
group is ever stale. A real trainer (seconds to minutes a step) is always the slow side; waiting here
makes that the case on any host, so a staleness test can count on stale groups existing.
"""
from __future__ import annotations

import time

from slime.rollout import fully_async_rollout

AHEAD_TIMEOUT_S = 300.0


def generate_rollout(args, rollout_id, data_buffer, evaluation: bool = False):
    out = fully_async_rollout.generate_rollout_fully_async(args, rollout_id, data_buffer, evaluation)
    if rollout_id + 1 < args.num_rollout:  # a weight update follows
        worker = fully_async_rollout._global_worker
        deadline = time.monotonic() + AHEAD_TIMEOUT_S
        while worker.queue_size() < worker.concurrency:
            if time.monotonic() > deadline:
                raise TimeoutError(f"slime's fully-async worker finished {worker.queue_size()} of its "
                                   f"{worker.concurrency} groups ahead in {AHEAD_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
    return out

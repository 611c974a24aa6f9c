"""Joining a weight-update group: the rendezvous slime's trainer and SGLang's engines share
(``slime/utils/distributed_utils.py``'s ``init_process_group``; SGLang's ``init_custom_process_group``).

Used by both sides here: the torch engine's receiver (:mod:`slime_ascend.rollout.torch_engine.weight_group`) and the
``opd`` teacher pool's push loader (:mod:`slime_ascend.opd.push_loader`), which sends as slime's trainer does.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Any

__all__ = ["DEFAULT_TIMEOUT_S", "join_group"]

DEFAULT_TIMEOUT_S = 120.0  # joining a group (the torch engine: and the tensors of one bucket arriving)


def _wait_for_port(host: str, port: int, deadline: float) -> None:
    """Until ``host:port`` accepts a TCP connection (the master's store is up), at most until ``deadline``
    (``time.monotonic()``); TimeoutError naming the last failure after it. torch's store client would instead try
    twice, each try waiting the whole timeout (an unreachable master took 2x the timeout and more)."""
    delay, last = 0.05, None
    while (left := deadline - time.monotonic()) > 0:
        try:
            with socket.create_connection((host, port), timeout=min(left, 5.0)):
                return
        except OSError as exc:
            last = exc
        time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(2 * delay, 1.0)
    raise TimeoutError(f"{host}:{port} accepted no connection ({last or 'no time left'})")


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """Join slime's weight-update group as ``rank``: the rendezvous of slime's ``init_process_group``
    (``slime/utils/distributed_utils.py``; SGLang's ``init_custom_process_group``): a TCP store at the master,
    prefixed by ``group_name``. No default process group is needed; returns the process group.

    One deadline, ``timeout_s`` from the call, covers the whole join: waiting for the master's store to accept
    (rank > 0), connecting to it and the process group's rendezvous each get what is left of it."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    deadline = time.monotonic() + timeout_s

    def left() -> timedelta:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no time left of the {timeout_s:g}s to join")
        return timedelta(seconds=remaining)

    if rank != 0:  # rank 0 hosts the store
        _wait_for_port(master_address, master_port, deadline)
    host = f"[{master_address}]" if ":" in master_address else master_address
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=left()))
    store.set_timeout(left())
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None, timeout=left())
    store.set_timeout(timedelta(seconds=timeout_s))
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # as slime's: dist.broadcast(group=) finds it
    return group

"""TEST DOUBLE: the ``hccl`` process-group backend of the emulated device (see :mod:`slime_ascend.npu_emulation`).

Registered as torch_npu registers its own (``torch_npu/_init/registry/distributed.py``:
``Backend.register_backend("hccl", ..., extended_api=True, devices=[...])``), with gloo underneath and
``devices=["npu", "cpu"]``, so ``dist.init_process_group("hccl")`` / ``new_group(backend="hccl")`` work and a
collective on ``npu`` tensors runs between processes: torch's ``c10d::*`` operators reach the ``npu`` tensors'
``__torch_dispatch__``, which passes their host tensors (same memory) to gloo, so results land in the ``npu``
tensors and outputs stay on ``npu``.

HCCL's environment is read as HCCL and torch_npu read it, and refused in one line where they would fail:

* ``HCCL_CONNECT_TIMEOUT`` (CANN: integer seconds in [120, 7200], default 120; the real wait is the value plus
  20 s) bounds connection setup;
* ``HCCL_EXEC_TIMEOUT`` (torch_npu ``OptionsManager::GetHCCLExecTimeout``: a negative value falls back to the
  default; 0 never times out) bounds each collective at the value plus 30 s (``kOpWaitTimeoutOffset``), inside
  the process group's own ``timeout``;
* ``HCCL_HOST_SOCKET_PORT_RANGE`` / ``HCCL_NPU_SOCKET_PORT_RANGE`` (CANN hcclenvref_07_0020 / _0021: ``auto``, or
  ports and ``LOW-HIGH`` ranges in [1, 65535] separated by commas, not overlapping) are checked for form, and
  ``HCCL_NPU_SOCKET_PORT_RANGE`` for the rule "in multi-card jobs, if it is set, every card of the communicator
  must set it": each rank publishes what it set through the group's store, and a mixed group fails at creation.

Timing, topology and HCCL's algorithms are not emulated: gloo over TCP on the host does the work.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

BACKEND = "hccl"
CONNECT_TIMEOUT_ENV = "HCCL_CONNECT_TIMEOUT"
EXEC_TIMEOUT_ENV = "HCCL_EXEC_TIMEOUT"
HOST_PORTS_ENV = "HCCL_HOST_SOCKET_PORT_RANGE"
NPU_PORTS_ENV = "HCCL_NPU_SOCKET_PORT_RANGE"
CONNECT_TIMEOUT_DEFAULT = 120
CONNECT_TIMEOUT_RANGE = (120, 7200)
CONNECT_EXTRA_S = 20  # CANN: the actual wait is HCCL_CONNECT_TIMEOUT + 20 s
EXEC_TIMEOUT_DEFAULT = 1836  # torch_npu ProcessGroupHCCL.cpp defaultExecTimeout
EXEC_EXTRA_S = 30  # torch_npu kOpWaitTimeoutOffset
ALL_CARDS_ENVS = (NPU_PORTS_ENV,)


class HcclEnvError(ValueError):
    """An HCCL environment variable HCCL itself would refuse (one line, naming the variable)."""


def _integer(name: str, value: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise HcclEnvError(f"{name}={value!r}: HCCL reads an integer number of seconds") from None


def connect_timeout_s(environ=os.environ) -> int:
    """Seconds HCCL waits for its links: ``HCCL_CONNECT_TIMEOUT`` (default 120) plus 20."""
    value = environ.get(CONNECT_TIMEOUT_ENV)
    if value is None or not value.strip():
        return CONNECT_TIMEOUT_DEFAULT + CONNECT_EXTRA_S
    seconds = _integer(CONNECT_TIMEOUT_ENV, value)
    low, high = CONNECT_TIMEOUT_RANGE
    if not low <= seconds <= high:
        raise HcclEnvError(f"{CONNECT_TIMEOUT_ENV}={value!r}: HCCL accepts {low} to {high} seconds")
    return seconds + CONNECT_EXTRA_S


def exec_timeout_s(environ=os.environ) -> int | None:
    """Seconds one collective may take (``HCCL_EXEC_TIMEOUT`` + 30), None for never (``0``)."""
    value = environ.get(EXEC_TIMEOUT_ENV)
    seconds = EXEC_TIMEOUT_DEFAULT if value is None or not value.strip() else _integer(EXEC_TIMEOUT_ENV, value)
    if seconds < 0:
        seconds = EXEC_TIMEOUT_DEFAULT  # torch_npu warns and resets a negative value to the default
    if seconds == 0:
        return None
    return seconds + EXEC_EXTRA_S


def parse_port_range(name: str, value: str) -> list[tuple[int, int]] | str:
    """``auto`` or the (low, high) port ranges of a CANN port-range variable; HcclEnvError when malformed."""
    text = value.strip()
    if text == "auto":
        return "auto"
    ranges: list[tuple[int, int]] = []
    for part in text.split(","):
        low_text, dash, high_text = part.strip().partition("-")
        try:
            low = int(low_text)
            high = int(high_text) if dash else low
        except ValueError:
            raise HcclEnvError(f"{name}={value!r}: use 'auto' or ports and LOW-HIGH ranges separated by commas, "
                               "e.g. 60000-60050") from None
        if not (1 <= low <= high <= 65535):
            raise HcclEnvError(f"{name}={value!r}: ports must lie in 1-65535, each range LOW-HIGH with LOW <= HIGH")
        ranges.append((low, high))
    ordered = sorted(ranges)
    for (_, high), (low, _) in zip(ordered, ordered[1:]):
        if low <= high:
            raise HcclEnvError(f"{name}={value!r}: the ports and ranges overlap")
    return ranges


def read_env(environ=os.environ) -> dict[str, Any]:
    """HCCL's environment as this backend uses it (validated; HcclEnvError names the variable)."""
    ports = {}
    for name in (HOST_PORTS_ENV, NPU_PORTS_ENV):
        value = environ.get(name)
        if value is not None:
            parse_port_range(name, value)
            ports[name] = value
    return {"connect_s": connect_timeout_s(environ), "exec_s": exec_timeout_s(environ), "ports": ports}


def check_all_cards(published: dict[int, dict[str, str]]) -> None:
    """CANN: in a multi-card communicator a port-range variable set on one card must be set on all."""
    if len(published) < 2:
        return
    for name in ALL_CARDS_ENVS:
        setting = sorted(rank for rank, ports in published.items() if name in ports)
        if setting and len(setting) != len(published):
            missing = sorted(set(published) - set(setting))
            raise HcclEnvError(f"{name} is set on rank(s) {setting} but not on rank(s) {missing} of one HCCL "
                               f"communicator; CANN requires every card of it to set it. Fix: export {name} in "
                               "the environment of every process of the job (e.g. Ray's runtime_env)")


def _publish_and_check(store, rank: int, size: int, ports: dict[str, str]) -> None:
    store.set(f"slime_ascend_hccl_env/{rank}", json.dumps(ports))
    published = {r: json.loads(store.get(f"slime_ascend_hccl_env/{r}")) for r in range(size)}
    # every rank has read every rank's variables before any raises: the rank that hosts the store would otherwise
    # exit with its error while another still reads, which then sees a reset connection instead of the same error
    store.set(f"slime_ascend_hccl_env_read/{rank}", "1")
    store.wait([f"slime_ascend_hccl_env_read/{r}" for r in range(size)])
    check_all_cards(published)


def create_backend(dist_backend_opts, pg_options=None):
    """The ``extended_api`` creator: a gloo backend for the group, after HCCL's environment checks."""
    import torch.distributed as dist

    env = read_env()
    store, rank, size = dist_backend_opts.store, dist_backend_opts.group_rank, dist_backend_opts.group_size
    _publish_and_check(store, rank, size, env["ports"])
    # built as torch builds its gloo groups (GLOO_SOCKET_IFNAME and the rest honoured), connecting within HCCL's
    # connect timeout, then each collective bounded by HCCL's execution timeout inside the group's own
    backend = dist.ProcessGroupGloo(store, rank, size, timeout=datetime.timedelta(seconds=env["connect_s"]))
    backend.options.global_ranks_in_group = dist_backend_opts.global_ranks_in_group
    backend.options.group_name = dist_backend_opts.group_id
    group_timeout = dist_backend_opts.timeout
    if env["exec_s"] is not None:
        group_timeout = min(group_timeout, datetime.timedelta(seconds=env["exec_s"]))
    backend._set_default_timeout(group_timeout)
    return backend


def is_hccl_available() -> bool:
    return True


def register() -> None:
    """Register ``hccl`` with torch.distributed (once per process), and ``torch.distributed.is_hccl_available``
    as torch_npu's distributed patches add it."""
    import torch.distributed as dist

    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, create_backend, extended_api=True, devices=["npu", "cpu"])
    dist.is_hccl_available = is_hccl_available

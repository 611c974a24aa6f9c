"""``torch.multiprocessing.spawn`` for the tests' gloo workers, forked from a server that has already imported torch
and Megatron's parallel state: each worker then costs a fork, not a fresh interpreter importing them (seconds of
CPU each, on CI's two cores).

The server is multiprocessing's forkserver: a fresh interpreter, started with the environment the workers are to
run under, so the plugin bootstrap (``slime_ascend_bootstrap.pth``, under ``SLIME_ASCEND_PLUGINS``) runs in it as
it would in a spawned worker, before the preloads. There is one server per environment (``PYTEST_CURRENT_TEST``
aside) and preload list, the last ``KEEP`` used kept running. Each worker checks that its server had one thread
when it forked and was started with the environment asked for.

The emulated-NPU hccl workers (tests/npu_emulation/emulated_hccl_workers.py, tests/rollout/sglang_npu_hccl_workers.py)
come from here too: the server imports torch but never installs the emulation (torch names its PrivateUse1 backend
once a process), each worker installs it in its own process. Still spawned: tests/startup (interpreter start-up is
what they test), the emulated checks files (tests/npu_emulation/emulated_process.py) and the process Megatron's
dist_checkpointing starts (tests/patch/test_distrib_optimizer_step.py).
"""

from __future__ import annotations

import os
import time
from multiprocessing import forkserver

import torch.multiprocessing as mp

from slime_ascend.demo.slime_job import free_port  # noqa: F401  (the workers' rendezvous port: zygote.free_port)

PRELOAD = ("torch.distributed", "megatron.core.parallel_state")  # a preload that fails to import is skipped
VOLATILE = "PYTEST_CURRENT_TEST"  # pytest's, different in every test: set in the worker instead
# set in the C environment only, not in os.environ (by readline, which pytest imports): what a spawned worker gets
TERMINAL = ("COLUMNS", "LINES")

KEEP = 3  # servers kept running (each holds torch and Megatron in memory), the least recently used stopped first

_servers: dict[tuple, forkserver.ForkServer] = {}


def _key(env: dict, preload) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k not in (VOLATILE, *TERMINAL))), tuple(preload)


def _server(env: dict, preload) -> forkserver.ForkServer:
    key = _key(env, preload)
    server = _servers.pop(key, None) or forkserver.ForkServer()
    _servers[key] = server  # now the most recently used
    while len(_servers) > KEEP:
        _servers.pop(next(iter(_servers)))._stop()
    server.set_forkserver_preload(list(preload))
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        server.ensure_running()  # (re)starts it if it is not running, with os.environ as it is now
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return server


def _worker(rank, fn, env, args):
    server = f"/proc/{os.getppid()}"
    threads = len(os.listdir(f"{server}/task"))
    if threads != 1:
        raise RuntimeError(f"the fork server ran {threads} threads when it forked this worker")
    with open(f"{server}/environ", "rb") as f:  # the server's environment at its start
        started = dict(item.split("=", 1) for item in os.fsdecode(f.read()).split("\0") if item)
    if _key(started, ()) != _key(env, ()):
        raise RuntimeError("the fork server was not started with the environment this worker was started with")
    if VOLATILE in env:
        os.environ[VOLATILE] = env[VOLATILE]
    fn(rank, *args)


def spawn(fn, args=(), nprocs=1, join=True, env=None, preload=PRELOAD, timeout=None):
    """``torch.multiprocessing.spawn(fn, args, nprocs, join)``, each worker forked from the server for ``env``, the
    workers' environment (default: this process's); ``timeout``: as in :func:`wait`. With ``join=False``, wait
    for the workers before spawning under ``KEEP`` other environments (their server would be stopped)."""
    env = dict(os.environ if env is None else env)
    server = _server(env, preload)
    connect = forkserver.connect_to_new_process  # what multiprocessing's forkserver Popen asks for a new process
    forkserver.connect_to_new_process = server.connect_to_new_process
    try:
        context = mp.start_processes(_worker, args=(fn, env, args), nprocs=nprocs, join=False,
                                     start_method="forkserver")
    finally:
        forkserver.connect_to_new_process = connect
    return wait(context, timeout) if join else context


def wait(context, timeout=None) -> None:
    """``context.join()`` until every worker is done (a worker's error is raised here, the others stopped); after
    ``timeout`` seconds kill the workers and raise TimeoutError."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not context.join(None if deadline is None else max(deadline - time.monotonic(), 0)):
        if deadline is not None and time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"the workers were still running after {timeout} s")

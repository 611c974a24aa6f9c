"""Shared test helpers.

Tests that need real THUDM/slime are marked ``slime`` and skipped (with the reason) when it, or a
package of the stack its real loop imports (``ci_net.SLIME_STACK``), is not installed: put an
unpacked slime source tree on PYTHONPATH and run ``bash scripts/install-slime-cpu.sh`` to run them.
Inside a ``slime`` test slime and its stack are imported plainly: an import that fails there fails.
A test (or a test file, at its top) that needs another package slime-ascend does not depend on calls
``need(module)``; one that needs something else the host may lack calls ``skip_outside_ci(reason)``.
Under SLIME_ASCEND_REQUIRE_SLIME=1 (CI) each of these is an error instead of a skip, and a ``slime``
or ``slow`` test that skips fails the run (``ci_net``'s hooks, imported here).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from slime_ascend.compat import typing_override

from ci_net import (  # noqa: F401  (pytest hooks: no slime/slow test may skip on CI)
    INSTALL_HINT,
    REQUIRE,
    absent,
    installed,
    pytest_collection_finish,
    pytest_collectreport,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

REPO = Path(__file__).resolve().parents[1]

# hypothesis: no per-example deadline anywhere (the tests check properties, never time; on CI's two cores busy with
# slime jobs one example of tests/verifiers/test_verifier_gate.py once took 19.8 s and hypothesis failed it for that)
with contextlib.suppress(ImportError):
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("slime-ascend", deadline=None)
    _hypothesis_settings.load_profile("slime-ascend")

# minutes per test module in the summary when --durations is given (CI passes it)
pytest_plugins = ("module_minutes",)


def slime_src() -> Path | None:
    """The slime source tree the tests use: the one ``import slime`` finds (``.ci/run`` puts
    ``SLIME_SRC``, default ``../shared/upstream/slime``, on PYTHONPATH), else ``$SLIME_SRC``."""
    spec = importlib.util.find_spec("slime")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve().parent
    value = os.environ.get("SLIME_SRC")
    return Path(value).resolve() if value else None


def slime_importable() -> bool:
    spec = importlib.util.find_spec("slime")
    if spec is None or not spec.submodule_search_locations:
        return False
    root = Path(next(iter(spec.submodule_search_locations)))
    return (root / "utils" / "accelerator" / "__init__.py").is_file()  # THUDM/slime, not the PyPI namesake


SLIME = slime_importable()
SLIME_REASON = "real THUDM/slime is not importable (put its source tree on PYTHONPATH to run this test)"

typing_override.ensure()  # megatron.training uses typing.override (Python 3.12), as the cpu plugin adds it


def slime_missing() -> str | None:
    """Why the ``slime`` tests cannot run here, or None: slime, or a package of its stack, is not installed."""
    if not SLIME:
        return SLIME_REASON
    missing = dict.fromkeys(module.partition(".")[0] for module in absent())  # the packages, in the stack's order
    return f"slime's dependencies are not installed: {', '.join(missing)} ({INSTALL_HINT})" if missing else None


def skip_outside_ci(reason: str) -> typing.NoReturn:
    """Skip the test (at a test file's top: the file) with ``reason``; on CI (SLIME_ASCEND_REQUIRE_SLIME=1),
    where nothing a test needs may be missing, fail with it."""
    __tracebackhide__ = True  # pytest reports the skip at the caller's line
    if REQUIRE:
        pytest.fail(f"SLIME_ASCEND_REQUIRE_SLIME=1 but {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def need(module: str, why: str = "") -> types.ModuleType:
    """``module`` imported, for a test that needs a package slime-ascend does not depend on: where it is not
    installed, ``skip_outside_ci`` naming it. Only absence skips: an installed package that fails to import
    fails. For slime's own modules the reason is ``slime_missing()``'s (slime, or a package of its stack)."""
    __tracebackhide__ = True
    if module.partition(".")[0] == "slime":
        reason = slime_missing()
    else:
        reason = None if installed(module) else f"{module} is not installed" + (f" ({why})" if why else "")
    if reason:
        skip_outside_ci(reason)
    return importlib.import_module(module)


def all_cases() -> bool:
    """SLIME_ASCEND_ALL_CASES=1: run the cases another case covers too (marked ``all_cases``, or left out of a module's
    parametrised list), which CI's default set leaves out."""
    return os.environ.get("SLIME_ASCEND_ALL_CASES") == "1"


def pytest_collection_modifyitems(config, items):
    # cases another case covers (marked all_cases; the module docstring says which): deselected, not skipped (on CI
    # a skip fails the run), unless SLIME_ASCEND_ALL_CASES=1
    if not all_cases():
        left_out = [item for item in items if item.get_closest_marker("all_cases")]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if not item.get_closest_marker("all_cases")]
    marked = [item for item in items if item.get_closest_marker("slime")]
    reason = slime_missing() if marked or REQUIRE else None
    if reason and REQUIRE:
        raise pytest.UsageError(f"SLIME_ASCEND_REQUIRE_SLIME=1 but {reason}; slime's tree is SLIME_SRC "
                                "(default ../shared/upstream/slime) on PYTHONPATH")
    for item in marked if reason else ():
        item.add_marker(pytest.mark.skip(reason=reason))


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (clean cwd), with ``env`` added to this environment."""
    full_env = dict(os.environ)
    full_env.pop("SLIME_ASCEND_PLUGINS", None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=str(REPO / "tests")
    )


@contextlib.contextmanager
def single_process_megatron():
    """A one-rank gloo process group and Megatron's parallel state (TP = PP = CP = 1), as slime's
    own CPU tests set them up; torn down afterwards if this call created them."""
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    created = False
    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
        created = True
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(1, 1)
    try:
        yield mpu
    finally:
        if created:
            mpu.destroy_model_parallel()
            dist.destroy_process_group()


@pytest.fixture
def opd_state(fresh_runtime, monkeypatch):
    """A fresh runtime without SLIME_ASCEND_PLUGINS, and the opd plugin's per-process state reset around a test."""
    from slime_ascend.opd import hooks

    monkeypatch.delenv("SLIME_ASCEND_PLUGINS", raising=False)
    hooks.reset_state()
    yield
    hooks.reset_state()


@pytest.fixture
def fresh_runtime():
    """Forget validated plugin selections and test-registered plugins around a test."""
    from slime_ascend.plugins import registry, runtime

    runtime.reset()
    before = dict(registry._extra)
    yield
    runtime.reset()
    registry._extra.clear()
    registry._extra.update(before)


@contextlib.contextmanager
def trickling_server(answer: bytes):
    """A loopback server that reads each request, then sends ``answer`` one byte a second: every read succeeds
    well inside any per-read timeout, so only a whole-request deadline stops a client. Yields its URL."""
    import socket
    import threading

    stop = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))

    def serve(conn):
        with conn:
            conn.recv(65536)
            for i in range(len(answer)):
                if stop.wait(1.0):
                    return
                try:
                    conn.sendall(answer[i:i + 1])
                except OSError:
                    return

    def accept():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()

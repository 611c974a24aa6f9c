"""A teacher that does not answer (refused, dropped) fails its samples as environment failures, not zero rewards.

The opd reward model asks a teacher on a loopback port nobody listens on, and one that closes each connection
unanswered: the sample is FAILED and removed (slime trains nothing on it), the reason is kept, its task reward
stays as the logged placeholder, and the post-process reports it (``rollout/opd_failed_samples``) and gives it
neutral teacher log-probs. Any other error (a bad route, a malformed answer) still stops the rollout."""

from __future__ import annotations

import asyncio
import socket
import threading
import types

import pytest

from slime_ascend.compat.sample import get_sample_class
from slime_ascend.opd import hooks
from slime_ascend.opd.plugin import PLUGIN

Sample = get_sample_class()
pytestmark = pytest.mark.usefixtures("opd_state")


def _refusing_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"  # closed again: connections are refused


@pytest.fixture
def dropping_url():
    """A server that accepts each connection and closes it without an answer."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    stop = threading.Event()

    def serve():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.recv(65536)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(timeout=5)
    server.close()


def _args(url: str, **overrides):
    values = {s.key: s.default for s in PLUGIN.settings}
    values.update(dict(PLUGIN.slime_args))
    values.update(ascend_plugins=["opd"], opd_teacher_load=None, rollout_temperature=1.0, use_rollout_logprobs=False,
                  hf_checkpoint=None, ascend_opd_request_retries=1, ascend_opd_request_timeout_s=5,
                  ascend_opd_teachers=[{"name": "math", "checkpoint_dir": "/nonexistent/math", "domains": ["math"],
                                        "url": url}])
    values.update(overrides)
    return types.SimpleNamespace(**values)


def _sample(index: int) -> Sample:
    s = Sample(index=index, tokens=[1, 2, 3, 4], response_length=2)
    s.metadata = {"domain": "math"}
    s.rollout_log_probs = [-0.5, -0.25]
    s.status = Sample.Status.COMPLETED
    return s


@pytest.mark.parametrize("where", ["refused", "dropped"])
def test_an_unreachable_teacher_fails_the_sample_as_an_environment_failure(where, dropping_url, caplog):
    url = _refusing_url() if where == "refused" else dropping_url
    args = _args(url)
    samples = [_sample(0), _sample(1)]
    rewards = asyncio.run(hooks.teacher_reward(args, samples))
    assert rewards == [0.0, 0.0]  # the task reward (none configured): a placeholder, the sample trains nothing
    for s in samples:
        assert s.status == Sample.Status.FAILED and s.remove_sample is True
        assert s.metadata["opd_failure"].startswith(f"teacher 'math' did not score it: request to {url}/generate "
                                                    "failed after 2 attempt(s)"), s.metadata
        assert "\n" not in s.metadata["opd_failure"]
    assert sum("failed as an environment failure" in r.getMessage() for r in caplog.records) == 2
    # the post-process keeps the batch rectangular (neutral log-probs: no OPD term) and reports the failures
    reports = []
    from slime_ascend.plugins import rollout_metrics

    original = rollout_metrics.report
    rollout_metrics.report = lambda args, log, name, metrics: reports.append(metrics)
    try:
        hooks.fill_teacher_log_probs(args, samples, [0.0, 0.0], [0.0, 0.0])
    finally:
        rollout_metrics.report = original
    assert [s.teacher_log_probs.tolist() for s in samples] == [[-0.5, -0.25]] * 2
    assert reports[-1]["rollout/opd_failed_samples"] == 2


def test_a_routing_error_still_stops_the_rollout():
    from slime_ascend.opd.router import RoutingError

    s = _sample(0)
    s.metadata = {"domain": "bio"}
    with pytest.raises(RoutingError):
        asyncio.run(hooks.teacher_reward(_args(_refusing_url()), s))

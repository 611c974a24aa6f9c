"""The ``cosched`` adapter and its patch on slime's own ``sglang_rollout.generate``: each request reaches the engine
the dispatcher chose (slime's generate with that engine's address), the slot is freed on success and on failure, and
the counts go out as rollout metrics."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from slime_ascend.cosched import hooks


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    hooks.reset()
    monkeypatch.setattr(hooks, "_settings", lambda args: SimpleNamespace(capacity=1, refresh_s=30.0))
    yield
    hooks.reset()


def _router_lists(monkeypatch, get):
    """slime's http_utils.get answers the router's /workers with ``get`` (a stand-in module where slime is absent)."""
    import sys
    import types

    module = sys.modules.get("slime.utils.http_utils") or types.ModuleType("slime.utils.http_utils")
    monkeypatch.setitem(sys.modules, "slime.utils.http_utils", module)
    monkeypatch.setattr(module, "get", get, raising=False)


def _args():
    return SimpleNamespace(sglang_router_ip="10.0.0.1", sglang_router_port=8000, sglang_server_concurrency=4)


def test_each_request_goes_to_a_free_engine_by_its_address(monkeypatch):
    seen = []

    async def workers(url):
        assert url == "http://10.0.0.1:8000/workers"
        return {"workers": [{"url": "http://127.0.0.1:30001"}, {"url": "http://127.0.0.1:30002"}]}

    _router_lists(monkeypatch, workers)

    async def slime_generate(args, sample, params):
        seen.append((args.sglang_router_ip, args.sglang_router_port, sample.session_id))
        await asyncio.sleep(0.01 * params["n"])
        return sample

    async def main():
        args = _args()
        samples = [SimpleNamespace(session_id=None) for _ in range(6)]
        await asyncio.gather(*(hooks.generate(slime_generate, args, s, {"n": i % 3}) for i, s in enumerate(samples)))
        assert args.sglang_router_ip == "10.0.0.1"  # slime's own args untouched
        return hooks.dispatcher(args).take_stats()

    stats = asyncio.run(main())
    assert {(ip, port) for ip, port, _ in seen} == {("127.0.0.1", 30001), ("127.0.0.1", 30002)}
    assert stats["rollout/cosched_requests"] == 6
    assert stats["rollout/cosched_engine0_dispatched"] + stats["rollout/cosched_engine1_dispatched"] == 6


def test_a_failed_request_frees_its_slot(monkeypatch):
    async def workers(url):
        return {"workers": [{"url": "http://127.0.0.1:30001"}]}

    _router_lists(monkeypatch, workers)

    async def failing(args, sample, params):
        raise ConnectionError("engine gone")

    async def ok(args, sample, params):
        return "done"

    async def main():
        with pytest.raises(ConnectionError):
            await hooks.generate(failing, _args(), SimpleNamespace(session_id="s"), {})
        return await asyncio.wait_for(hooks.generate(ok, _args(), SimpleNamespace(session_id="s"), {}), 2)

    assert asyncio.run(main()) == "done"


def test_a_router_without_workers_is_one_clear_error(monkeypatch):
    async def none(url):
        return {"workers": []}

    _router_lists(monkeypatch, none)
    with pytest.raises(RuntimeError, match="lists no worker"):
        asyncio.run(hooks.generate(None, _args(), SimpleNamespace(session_id=None), {}))


def test_report_hands_the_counts_to_slimes_rollout_metrics_and_keeps_rewards(monkeypatch):
    published = []
    monkeypatch.setattr("slime_ascend.plugins.rollout_metrics.report",
                        lambda args, logger, name, metrics: published.append((name, metrics)))
    assert hooks.report(_args(), [], [1.0], [0.5]) == ([1.0], [0.5])  # nothing dispatched yet: nothing to say
    hooks.dispatcher(_args())
    assert hooks.report(_args(), [], [1.0], [0.5]) == ([1.0], [0.5])
    assert published and published[0][0] == "cosched" and "rollout/cosched_moves" in published[0][1]


@pytest.mark.slime
def test_the_patch_wraps_slimes_generate_and_comes_off_again():
    from conftest import need

    sglang_rollout = need("slime.rollout.sglang_rollout")
    from slime_ascend import patch

    p = patch.get("rollout.cosched_generate")
    assert p.verify() == []
    original = sglang_rollout.generate
    p.install()
    try:
        assert sglang_rollout.generate is not original and sglang_rollout.generate.__wrapped__ is original
    finally:
        p.remove()
    assert sglang_rollout.generate is original

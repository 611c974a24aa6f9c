"""The ``cosched`` adapter and its patch on slime's own ``sglang_rollout.generate``: each request reaches the engine
the dispatcher chose (slime's generate with that engine's address), the slot is freed on success and on failure, and
the counts go out as rollout metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from types import SimpleNamespace

import pytest

from slime_ascend.cosched import hooks
from slime_ascend.cosched import sessions as cosched_sessions


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    hooks.reset()
    monkeypatch.setattr(hooks, "_settings", lambda args: SimpleNamespace(capacity=1, refresh_s=30.0, unit="requests", kv_fraction=0.9))
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


# -- compaction: every turn of an episode dispatched as one session -------------------------------------------
ROUTER = "http://10.0.0.1:8000/generate"
ENGINES = ("http://127.0.0.1:30001", "http://127.0.0.1:30002")


def _fakes():
    """tests/compaction/compaction_fakes.py (the offline tiny tokenizer and the scripted engine)."""
    import importlib
    import sys
    from pathlib import Path

    here = str(Path(__file__).parents[1] / "compaction")
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module("compaction_fakes")


def _compaction_args():
    return SimpleNamespace(ascend_compaction_context_budget=3000, ascend_compaction_trigger_tokens=1200,
                           ascend_compaction_env_kwargs={"num_facts": 6}, sglang_router_ip="10.0.0.1",
                           sglang_router_port=8000, sglang_server_concurrency=4)


class _Served:
    """One engine behind a URL, as one session sees it: compaction_fakes' scripted policy, and the meta a torch
    engine sends (``cached_tokens``: the prompt's common prefix with the session's earlier prompts on this engine,
    at most all but its last token; the prefix's version ``cached_version``, default the answer's)."""

    def __init__(self, url, tok, log, version="1", cached_version=None):
        self.url, self.log, self.version, self.cached_version = url, log, version, cached_version
        self.fake = _fakes().FakeEngine(tok, _fakes().memory_policy, weight_version=version)
        self.seen: list[list[int]] = []

    async def generate(self, input_ids, sampling_params):
        await asyncio.sleep(0.001 * (len(self.log) % 3))  # interleave the sessions
        result = await self.fake.generate(input_ids, sampling_params)
        ids = list(input_ids)

        def common(p):
            return next((i for i, (a, b) in enumerate(zip(p, ids)) if a != b), min(len(p), len(ids)))

        cached = min(max((common(p) for p in self.seen), default=0), len(ids) - 1)
        self.seen.append(ids)
        self.log.append(self.url)
        meta = {"prompt_tokens": len(ids), "cached_tokens": cached, "weight_version": self.version,
                "cached_weight_version": (self.cached_version or self.version) if cached else None}
        return dataclasses.replace(result, meta_info=meta)


def _routed_compaction(monkeypatch, capacity, sessions, **served_kw):
    """``sessions`` compaction episodes at once through :func:`sessions.route_episode` (as compaction's generate
    calls its episode router, with its client to slime's router), two engines of ``capacity`` slots; returns the episodes'
    segments, the dispatcher's counts and, per session, the engine of each turn."""
    import contextvars

    from slime_ascend.compaction import generate as gen_mod
    from slime_ascend.compaction.generate import CompactionRuntime, CompactionSettings
    from slime_ascend.compat.sample import get_sample_class
    from slime_ascend.rollout.engine_client import EngineClient

    monkeypatch.setattr(hooks, "_settings", lambda args: SimpleNamespace(capacity=capacity, refresh_s=30.0, unit="requests", kv_fraction=0.9))

    async def workers(url):
        return {"workers": [{"url": u} for u in ENGINES]}

    _router_lists(monkeypatch, workers)
    tok = _fakes().make_tiny_tokenizer()
    logs: dict[str, list[str]] = {}
    current = contextvars.ContextVar("session")

    class PerSession:  # the engine at one URL: a _Served per session, logging into that session's list
        def __init__(self, url):
            self.url, self.by_session = url, {}

        async def generate(self, input_ids, params):
            session = current.get()
            if session not in self.by_session:
                self.by_session[session] = _Served(self.url, tok, logs[session], **served_kw)
            return await self.by_session[session].generate(input_ids, params)

    served = {url: PerSession(url) for url in ENGINES}
    monkeypatch.setattr(cosched_sessions, "_client", served.__getitem__)
    args = _compaction_args()

    async def episode(i):
        current.set(f"s{i}")
        logs[f"s{i}"] = []
        sample = get_sample_class()(index=i, prompt="p", metadata={"seed": i}, session_id=f"s{i}")
        return await cosched_sessions.route_episode(
            gen_mod.run_compaction_rollout, args, sample, {"max_new_tokens": 400, "temperature": 1.0},
            settings=CompactionSettings.from_args(args), runtime=CompactionRuntime(tok, EngineClient(ROUTER)))

    async def main():
        outs = await asyncio.gather(*(episode(i) for i in range(sessions)))
        return outs, hooks.dispatcher(args).take_stats()

    outs, stats = asyncio.run(main())
    return outs, stats, logs


@pytest.mark.parametrize("capacity, sessions", [(4, 2), (1, 4), (2, 5)])
def test_compaction_turns_stay_on_their_owner_or_move_counted(monkeypatch, capacity, sessions):
    outs, stats, logs = _routed_compaction(monkeypatch, capacity, sessions)
    assert any(len(segments) > 1 for segments in outs)  # episodes compacted: their turns span segments
    turns = sum(len(urls) for urls in logs.values())
    later = sum(len(urls) - 1 for urls in logs.values())
    stayed = sum(a == b for urls in logs.values() for a, b in itertools.pairwise(urls))
    assert stats["rollout/cosched_requests"] == stats["rollout/cosched_answers"] == turns
    assert stats["rollout/cosched_session_turns"] == later > 0
    assert stats["rollout/cosched_owner_turns"] == stayed and stats["rollout/cosched_moves"] == later - stayed
    assert stats["rollout/cosched_stale_prefix_answers"] == 0 and stats["rollout/cosched_prefix_version_unreported"] == 0
    cached = stats["rollout/cosched_engine0_cached_tokens"] + stats["rollout/cosched_engine1_cached_tokens"]
    assert cached >= stats["rollout/cosched_owner_cached_tokens"] > 0  # a later turn on its owner reused its prefix
    if capacity * len(ENGINES) >= sessions:  # room everywhere: no session ever leaves its engine
        assert stats["rollout/cosched_moves"] == 0 and all(len(set(urls)) == 1 for urls in logs.values())
    assert hooks._dispatcher.owner("s0") is None  # the episode's end forgot the session


def test_a_prefix_of_another_version_is_counted(monkeypatch):
    _, stats, _ = _routed_compaction(monkeypatch, 4, 2, version="2", cached_version="1")
    assert stats["rollout/cosched_stale_prefix_answers"] > 0


def test_the_process_start_hook_routes_compaction_and_leaves_other_engines_alone(monkeypatch):
    from slime_ascend.compaction import generate as gen_mod

    monkeypatch.setattr(gen_mod, "_episode_router", None)  # restored after the test
    cosched_sessions.process_start()  # compaction.generate is imported: routed at once
    assert gen_mod._episode_router is cosched_sessions.route_episode

    from slime_ascend.compaction.generate import CompactionRuntime, CompactionSettings
    from slime_ascend.compat.sample import get_sample_class

    args = _compaction_args()
    tok = _fakes().make_tiny_tokenizer()
    engine = _fakes().FakeEngine(tok, _fakes().memory_policy)  # a runtime that does not talk to slime's router: untouched
    out = asyncio.run(cosched_sessions.route_episode(
        gen_mod.run_compaction_rollout, args, get_sample_class()(index=1, prompt="p", session_id="s"),
        {"max_new_tokens": 400}, settings=CompactionSettings.from_args(args), runtime=CompactionRuntime(tok, engine)))
    assert out and engine.calls and hooks._dispatcher is None


def test_the_stale_prefix_check_reads_the_engines_report():
    assert cosched_sessions.stale_prefix({"cached_tokens": 0}) is False
    assert cosched_sessions.stale_prefix({"cached_tokens": 5, "weight_version": "2", "cached_weight_version": "2"}) is False
    assert cosched_sessions.stale_prefix({"cached_tokens": 5, "weight_version": "2", "cached_weight_version": "1"}) is True
    assert cosched_sessions.stale_prefix({"cached_tokens": 5, "weight_version": "2"}) is None  # SGLang: no tag


def test_the_torch_engine_reports_the_version_of_the_prefix_it_reused(monkeypatch):
    """The engine side of the check: ``cached_weight_version`` is the reused entry's own tag, so a prefix kept
    across a switch (the switch's drop disabled here) shows as another version than the answer's."""
    from slime_ascend.rollout.torch_engine.engine import TorchEngine

    engine = TorchEngine(return_original_logprob=False, prefix_cache_tokens=4096)
    payload = {"input_ids": list(range(5, 45)), "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
    first = engine.generate(payload)["meta_info"]
    assert first["cached_tokens"] == 0 and first["cached_weight_version"] is None
    again = engine.generate({**payload, "input_ids": payload["input_ids"] + [7, 8]})["meta_info"]
    assert again["cached_tokens"] > 0 and cosched_sessions.stale_prefix(again) is False
    assert again["cached_weight_version"] == again["weight_version"] == "default"
    monkeypatch.setattr(engine._prefix_cache, "switch", lambda version: (0, 0))  # keeps the old entries
    engine._switch_to({k: v.clone() for k, v in engine.model.state_dict().items()}, "v1", source="test")
    stale = engine.generate({**payload, "input_ids": payload["input_ids"] + [7, 8, 9]})["meta_info"]
    assert stale["cached_tokens"] > 0 and stale["weight_version"] == "v1"
    assert stale["cached_weight_version"] == "default" and cosched_sessions.stale_prefix(stale) is True


def test_kv_unit_budgets_from_each_engines_loads_and_costs_from_prompt_and_max_new_tokens(monkeypatch):
    """``ascend_cosched_unit: kv_tokens``: each engine's budget is its /v1/loads max_total_num_tokens (summed over DP
    ranks) x kv_fraction; a request costs its prompt tokens plus max_new_tokens."""
    monkeypatch.setattr(hooks, "_settings", lambda args: SimpleNamespace(capacity=1, refresh_s=30.0, unit="kv_tokens",
                                                                         kv_fraction=0.5))
    loads = {"http://e1:1": [{"dp_rank": 0, "max_total_num_tokens": 400}],
             "http://e2:2": [{"dp_rank": 0, "max_total_num_tokens": 100}, {"dp_rank": 1, "max_total_num_tokens": 100}]}

    async def get(url):
        if url.endswith("/workers"):
            return {"workers": [{"url": u, "worker_type": "regular"} for u in loads]}
        return {"loads": loads[url.removesuffix("/v1/loads")]}

    _router_lists(monkeypatch, get)
    placed = []

    async def slime_generate(args, sample, params):
        placed.append(args.sglang_router_port)
        await asyncio.sleep(0.01)
        return sample

    async def main():
        args = _args()
        samples = [SimpleNamespace(session_id=None, tokens=list(range(30))) for _ in range(3)]
        # each costs 30 + 120 = 150: e1 (budget 200) takes one, e2 (budget 100) takes one alone (oversized), the
        # third waits for e1
        await asyncio.gather(*(hooks.generate(slime_generate, args, s, {"max_new_tokens": 120}) for s in samples))
        d = hooks.dispatcher(args)
        return d, d.take_stats()

    d, stats = asyncio.run(main())
    assert d.unit == "kv_tokens" and stats["rollout/cosched_engine0_budget"] == 200
    assert stats["rollout/cosched_engine1_budget"] == 100 and stats["rollout/cosched_oversized"] == 1
    assert sorted(placed) == [1, 1, 2] and stats["rollout/cosched_requests"] == 3


@pytest.mark.parametrize("where", ["workers", "loads"])
def test_a_prefill_decode_disaggregated_deployment_is_refused_in_one_line(monkeypatch, where):
    monkeypatch.setattr(hooks, "_settings", lambda args: SimpleNamespace(capacity=1, refresh_s=30.0, unit="kv_tokens",
                                                                         kv_fraction=0.9))

    async def get(url):
        if url.endswith("/workers"):
            return {"workers": [{"url": "http://p:1", "worker_type": "prefill" if where == "workers" else "regular"}]}
        return {"loads": [{"max_total_num_tokens": 100, "disaggregation": {"mode": "decode"}}]}

    _router_lists(monkeypatch, get)

    async def never(args, sample, params):
        raise AssertionError("dispatched")

    with pytest.raises(RuntimeError) as err:
        asyncio.run(hooks.generate(never, _args(), SimpleNamespace(session_id=None, tokens=[1]), {}))
    assert "prefill/decode-disaggregated" in str(err.value) and "\n" not in str(err.value)


def test_kv_unit_without_a_reported_kv_capacity_is_one_line(monkeypatch):
    monkeypatch.setattr(hooks, "_settings", lambda args: SimpleNamespace(capacity=1, refresh_s=30.0, unit="kv_tokens",
                                                                         kv_fraction=0.9))

    async def get(url):
        if url.endswith("/workers"):
            return {"workers": [{"url": "http://e:1"}]}
        return {"loads": [{"dp_rank": 0, "num_running_reqs": 0}]}

    _router_lists(monkeypatch, get)
    with pytest.raises(RuntimeError, match="reports no max_total_num_tokens.*--max-total-tokens"):
        asyncio.run(hooks.generate(None, _args(), SimpleNamespace(session_id=None, tokens=[1]), {}))

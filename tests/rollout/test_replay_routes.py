"""rollout.replay_routes: under --use-rollout-routing-replay, the engines' routes reach slime past its router, or
parse_args says why not in one line (the router from PyPI drops the request's return_routed_experts)."""

from __future__ import annotations

import types

import pytest

from slime_ascend.rollout import replay_routes
from slime_ascend.rollout.torch_engine.engine import TorchEngine
from slime_ascend.rollout.torch_engine.model import load_model, save_model


def _args(**overrides):
    return types.SimpleNamespace(**{"use_rollout_routing_replay": True, "rollout_external_engine_addrs": None,
                                    **overrides})


@pytest.fixture
def pypi_router(monkeypatch):
    monkeypatch.setattr(replay_routes, "router_version", lambda: "0.3.2")


def test_no_replay_and_slimes_router_fork_pass(monkeypatch):
    assert replay_routes.refusal(_args(use_rollout_routing_replay=False), managed_engines_add_routes=False) is None
    monkeypatch.setattr(replay_routes, "router_version", lambda: "0.3.2+slime.9daabcd")
    assert replay_routes.refusal(_args(), managed_engines_add_routes=False) is None
    assert replay_routes.router_forwards_routes(None) is False


def test_managed_sglang_behind_the_pypi_router_is_refused(pypi_router):
    message = replay_routes.refusal(_args(), managed_engines_add_routes=False)
    assert message.startswith("--use-rollout-routing-replay: slime's router (sglang-router 0.3.2, not slime's fork "
                              "of it) drops each request's return_routed_experts") and "Fix: install slime's router" \
        in message and "\n" not in message, message
    assert replay_routes.refusal(_args(), managed_engines_add_routes=True) is None  # slime-managed torch engines


def test_external_engines_pass_only_when_they_add_routes_to_every_answer(pypi_router):
    infos = {"a:1": {"routed_experts_in_every_answer": True}, "b:2": {"enable_return_routed_experts": True},
             "c:3": None}
    args = _args(rollout_external_engine_addrs=["a:1", "c:3"])
    assert replay_routes.refusal(args, managed_engines_add_routes=False, server_info=infos.get) is None
    args = _args(rollout_external_engine_addrs=["a:1", "b:2"])
    message = replay_routes.refusal(args, managed_engines_add_routes=True, server_info=infos.get)
    assert "the engine at b:2 adds routes only when a request asks" in message and \
        "Fix: start it with `slime-ascend serve-torch --enable-return-routed-experts`" in message, message


def test_a_served_torch_engine_answers_the_probe(pypi_router, tmp_path):
    """The probe reads the real /server_info of a served engine, with and without the flag."""
    model_dir = save_model(load_model(None, moe=True, seed=1), tmp_path / "m")
    for flag, expected in ((True, None), (False, "adds routes only when a request asks")):
        engine = TorchEngine(str(model_dir), enable_return_routed_experts=flag)
        with engine.start_in_thread(host="127.0.0.1", port=0) as url:
            addr = url.removeprefix("http://")
            message = replay_routes.refusal(_args(rollout_external_engine_addrs=[addr]),
                                            managed_engines_add_routes=False)
        assert message is None if expected is None else expected in message, message

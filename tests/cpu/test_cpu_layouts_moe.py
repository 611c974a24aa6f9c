"""The cpu plugin's layout check for MoE models: MoE and expert parallelism pass; the TransformerEngine kernels
slime's MoE scripts pass are refused with one line;
routing replay passes (train.routing_replay wires it into a Megatron-core without slime's Megatron patch), and
rollout routing replay where the engines' routes reach slime (rollout.replay_routes)."""

import types

import pytest

from slime_ascend.cpu import plugin
from slime_ascend.patch.train import routing_replay
from slime_ascend.plugins.settings import SettingsError


def _args(**overrides):
    base = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                sequence_parallel=False, num_experts=4, expert_model_parallel_size=2, moe_grouped_gemm=False,
                moe_permute_fusion=False, use_rollout_routing_replay=False, use_routing_replay=False)
    return types.SimpleNamespace(**{**base, **overrides})


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    monkeypatch.setattr("slime_ascend.cpu.ray_capacity.check", lambda args: None)


@pytest.mark.parametrize("overrides", [{}, {"expert_model_parallel_size": 1}, {"pipeline_model_parallel_size": 2}])
def test_moe_and_expert_parallelism_pass(overrides):
    plugin.validate(_args(**overrides), None)


@pytest.mark.parametrize("overrides, expected", [
    ({"moe_grouped_gemm": True}, "cpu: --moe-grouped-gemm is not supported on the host (grouped GEMM needs "
                                 "TransformerEngine"),
    ({"moe_permute_fusion": True}, "cpu: --moe-permute-fusion is not supported on the host (the fused token "
                                   "permutation needs TransformerEngine"),
])
def test_transformer_engine_moe_kernels_are_refused(overrides, expected):
    with pytest.raises(SettingsError) as info:
        plugin.validate(_args(**overrides), None)
    message = str(info.value)
    assert message.startswith(expected) and "\n" not in message and f"Fix: drop --{expected.split('--')[1].split()[0]}" \
        in message, message


def test_rollout_routing_replay_behind_the_pypi_router_is_refused_in_one_line(monkeypatch):
    """slime-managed engines that are not torch engines (SGLang) get no routes past sglang-router from PyPI; the
    torch engines the torch-engine plugin starts add them to every answer (rollout.replay_routes)."""
    monkeypatch.setattr("slime_ascend.rollout.replay_routes.router_version", lambda: "0.3.2")
    args = _args(use_rollout_routing_replay=True, use_routing_replay=True, rollout_external_engine_addrs=None)
    monkeypatch.setenv("SLIME_ASCEND_PLUGINS", "cpu")
    with pytest.raises(SettingsError) as info:
        plugin.validate(args, None)
    message = str(info.value)
    assert message.startswith("cpu: --use-rollout-routing-replay: slime's router (sglang-router 0.3.2") \
        and "Fix: install slime's router" in message and "\n" not in message, message
    monkeypatch.setenv("SLIME_ASCEND_PLUGINS", "cpu,torch-engine")
    plugin.validate(args, None)


@pytest.mark.parametrize("flag", ["use_routing_replay"])
def test_routing_replay_passes_and_declares_its_patch_for_an_unpatched_megatron(flag, monkeypatch):
    """Replay runs on the host (train.routing_replay wires slime's replay into a stock Megatron-core); with slime's
    own Megatron patch installed the runtime patch is not wanted (it would record each route twice)."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe import moe_utils

    args = _args(**{flag: True, "use_routing_replay": True})  # slime's parse_args sets it for rollout replay
    plugin.validate(args, None)
    uses = {u.patch: u for u in plugin.PLUGIN.patches}
    assert (uses["train.routing_replay"].moment, uses["train.routing_replay"].when) == (
        "train", "slime_ascend.patch.train.routing_replay.wanted")
    assert routing_replay.wanted(args) is True  # this host's Megatron-core is unpatched
    assert routing_replay.wanted(_args()) is False

    def patched(*args, **kwargs):  # what slime's patch adds to the function
        from slime.utils.routing_replay import get_routing_replay_compute_topk  # noqa: F401

    monkeypatch.setattr(moe_utils, "topk_routing_with_score_function", patched)
    assert routing_replay.wanted(args) is False

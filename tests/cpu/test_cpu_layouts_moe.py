"""The cpu plugin's layout check for MoE models: MoE and expert parallelism pass; the TransformerEngine kernels
slime's MoE scripts pass, and routing replay without slime's Megatron patch, are refused with one line."""

import types

import pytest

from slime_ascend.cpu import plugin
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


@pytest.mark.parametrize("flag", ["use_rollout_routing_replay", "use_routing_replay"])
def test_routing_replay_needs_slimes_megatron_patch(flag, monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe import moe_utils

    cli = "--" + flag.replace("_", "-")
    with pytest.raises(SettingsError) as info:  # this host's Megatron-core is unpatched
        plugin.validate(_args(**{flag: True}), None)
    message = str(info.value)
    assert message.startswith(f"cpu: {cli} is not supported on the host (slime's routing replay needs its Megatron "
                              "patch") and "\n" not in message and f"Fix: drop {cli}" in message, message

    def patched(*args, **kwargs):  # what slime's patch adds to the function
        from slime.utils.routing_replay import get_routing_replay_compute_topk  # noqa: F401

    monkeypatch.setattr(moe_utils, "topk_routing_with_score_function", patched)
    plugin.validate(_args(**{flag: True}), None)

"""The cpu plugin's check of expert tensor parallelism for MoE models: above 1 (Megatron's default is the TP size)
it is refused in one line naming ``--expert-tensor-parallel-size`` (Megatron's all-to-all dispatcher gathers the
expert-TP group's tokens in uneven pieces: ``torch.distributed.all_gather`` of a list of sizes, which gloo
refuses, "ProcessGroupGloo::allgather: invalid tensor size", measured in four gloo processes at TP 2 x EP 2); at 1,
what every MoE script of slime passes and what ``slime-ascend config --flags --ep N`` prints, the layout passes."""

import shlex
import types

import pytest

from slime_ascend.cpu import plugin
from slime_ascend.parallel_layout import Layout
from slime_ascend.plugins.settings import SettingsError


def _args(**overrides):
    base = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, context_parallel_size=1,
                sequence_parallel=True, num_experts=4, expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                moe_grouped_gemm=False, moe_permute_fusion=False, use_rollout_routing_replay=False,
                use_routing_replay=False, actor_num_nodes=1, actor_num_gpus_per_node=4)
    return types.SimpleNamespace(**{**base, **overrides})


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    monkeypatch.setattr("slime_ascend.cpu.ray_capacity.check", lambda args: None)


@pytest.mark.parametrize("overrides, shown", [
    ({"expert_tensor_parallel_size": 2}, "--expert-tensor-parallel-size 2 is not supported"),
    # the driver's parse_args before Megatron's validate_args: None is the TP size
    ({"expert_tensor_parallel_size": None}, "--expert-tensor-parallel-size 2 (Megatron's default: the "
                                            "--tensor-model-parallel-size) is not supported"),
    ({"expert_tensor_parallel_size": 2, "expert_model_parallel_size": 1}, "--expert-tensor-parallel-size 2 is not"),
])
def test_moe_with_expert_tensor_parallelism_above_one_is_refused_in_one_line(overrides, shown):
    with pytest.raises(SettingsError) as info:
        plugin.validate(_args(**overrides), None)
    message = str(info.value)
    assert message.startswith("cpu: " + shown) and "Fix: --expert-tensor-parallel-size 1" in message \
        and "\n" not in message, message


@pytest.mark.parametrize("overrides", [
    {},  # TP 2 x EP 2, expert TP 1: slime's MoE scripts' layout (tests/e2e/test_slime_moe_cpu.py runs it)
    {"expert_tensor_parallel_size": None, "tensor_model_parallel_size": 1, "sequence_parallel": False},
    {"num_experts": None, "expert_tensor_parallel_size": None},  # a dense model: no experts, no check
    {"num_experts": None, "expert_tensor_parallel_size": 2},
])
def test_expert_tensor_parallelism_one_and_dense_models_pass(overrides):
    plugin.validate(_args(**overrides), None)


@pytest.mark.parametrize("layout", [Layout(ep=2), Layout(tp=2, ep=2, sp=True), Layout(ep=2, dp=4)])
def test_the_layout_flags_config_prints_for_expert_parallelism_pass_with_an_moe_model(layout):
    words = layout.flags()
    assert words[words.index("--expert-tensor-parallel-size") + 1] == "1", shlex.join(words)
    args = _args(**{**layout.slime_args(), "actor_num_nodes": 1})
    assert args.expert_tensor_parallel_size == 1
    plugin.validate(args, None)
    assert "--expert-tensor-parallel-size" not in Layout(tp=2).flags()  # a dense layout keeps Megatron's default


def test_moe_at_tensor_parallel_without_sequence_parallel_is_refused_in_one_line():
    """Megatron's MoELayer raises this in the train actor (after Ray and the engines started); refused at start."""
    with pytest.raises(SettingsError) as info:
        plugin.validate(_args(sequence_parallel=False), None)
    message = str(info.value)
    assert message.startswith("cpu: an MoE model at --tensor-model-parallel-size 2 needs --sequence-parallel") \
        and message.endswith("Fix: add --sequence-parallel") and "\n" not in message, message
    plugin.validate(_args(num_experts=None, sequence_parallel=False), None)  # a dense model at TP 2 without SP runs

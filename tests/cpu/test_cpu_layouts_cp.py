"""The cpu plugin's check of context parallelism: CP alone passes (both of slime's layouts), each untested combination
is refused with one line naming the flag."""

import types

import pytest

from slime_ascend.cpu import plugin
from slime_ascend.plugins.settings import SettingsError


def _args(**overrides):
    base = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=2,
                sequence_parallel=False, num_experts=None, expert_model_parallel_size=1, actor_num_nodes=1,
                actor_num_gpus_per_node=2, allgather_cp=False)
    return types.SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize("allgather_cp", [False, True])
def test_context_parallel_alone_passes(allgather_cp, monkeypatch):
    monkeypatch.setattr("slime_ascend.cpu.ray_capacity.check", lambda args: None)  # no Ray here
    plugin.validate(_args(allgather_cp=allgather_cp), None)


@pytest.mark.parametrize("overrides, expected", [
    ({"tensor_model_parallel_size": 2, "actor_num_gpus_per_node": 4},
     "cpu: --tensor-model-parallel-size 2 with --context-parallel-size 2 is not supported on the host"),
    ({"pipeline_model_parallel_size": 2, "actor_num_gpus_per_node": 4},
     "cpu: --pipeline-model-parallel-size 2 with --context-parallel-size 2 is not supported on the host"),
    ({"actor_num_gpus_per_node": 4},
     "cpu: --actor-num-gpus-per-node 4 with --context-parallel-size 2 is not supported on the host"),
])
def test_context_parallel_combined_is_refused_by_flag(overrides, expected):
    with pytest.raises(SettingsError) as info:
        plugin._check_context_parallel(_args(**overrides), SettingsError)
    message = str(info.value)
    assert message.startswith(expected) and "\n" not in message and "Fix: " in message, message

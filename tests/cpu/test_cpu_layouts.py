"""The cpu plugin's layout check: what the host runs passes, the rest is refused with one line naming the flag."""

import types

import pytest

from slime_ascend.cpu import plugin
from slime_ascend.plugins.settings import SettingsError


def _args(**overrides):
    base = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2, context_parallel_size=1,
                sequence_parallel=False, num_experts=None, expert_model_parallel_size=1)
    return types.SimpleNamespace(**{**base, **overrides})


def test_pipeline_and_data_parallel_dense_pass_and_tensor_parallel_only_when_allowed(monkeypatch):
    monkeypatch.delenv(plugin.ALLOW_TP, raising=False)
    plugin.validate(_args(tensor_model_parallel_size=1), None)
    with pytest.raises(SettingsError, match=r"cpu: --tensor-model-parallel-size 2 is not supported on the host "
                                            r"\(its train-side log-probs do not yet match one rank"):
        plugin.validate(_args(tensor_model_parallel_size=2), None)
    monkeypatch.setenv(plugin.ALLOW_TP, "1")
    plugin.validate(_args(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), None)
    plugin.validate(types.SimpleNamespace(), None)  # a slime without these args: nothing to refuse


@pytest.mark.parametrize("overrides, expected", [
    ({"context_parallel_size": 2}, "cpu: --context-parallel-size 2 is not supported on the host (slime_ascend.cpu.spec's "
                                   "packed attention has no context-parallel exchange). Fix: --context-parallel-size 1"),
    ({"sequence_parallel": True}, "cpu: --sequence-parallel is not supported on the host"),
    ({"num_experts": 8}, "cpu: --num-experts 8 is not supported on the host"),
    ({"expert_model_parallel_size": 2}, "cpu: --expert-model-parallel-size 2 is not supported"),
])
def test_unsupported_layouts_are_refused(overrides, expected):
    with pytest.raises(SettingsError) as info:
        plugin.validate(_args(**overrides), None)
    message = str(info.value)
    assert message.startswith(expected) and "\n" not in message and "Fix: " in message, message
    if "num_experts" in overrides or "sequence_parallel" in overrides:
        assert "Fix: drop --" in message


def test_the_plugin_declares_the_check():
    assert plugin.PLUGIN.validate == "slime_ascend.cpu.plugin.validate"

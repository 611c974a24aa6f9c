"""The cpu plugin's layout check: what the host runs passes, the rest is refused with one line naming the flag
(context parallelism: tests/cpu/test_cpu_layouts_cp.py)."""

import types

import pytest

from slime_ascend.cpu import plugin
from slime_ascend.plugins.settings import SettingsError


def _args(**overrides):
    base = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2, context_parallel_size=1,
                sequence_parallel=False, num_experts=None, expert_model_parallel_size=1)
    return types.SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize("overrides", [
    {}, {"tensor_model_parallel_size": 2}, {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
])
def test_tensor_pipeline_and_data_parallel_pass(overrides, monkeypatch):
    monkeypatch.setattr("slime_ascend.cpu.ray_capacity.check", lambda args: None)  # no Ray here
    plugin.validate(_args(**overrides), None)


def test_a_slime_without_these_args_passes(monkeypatch):
    monkeypatch.setattr("slime_ascend.cpu.ray_capacity.check", lambda args: None)
    plugin.validate(types.SimpleNamespace(), None)


@pytest.mark.parametrize("flag, attr, supported, why", plugin.UNSUPPORTED, ids=[u[0] for u in plugin.UNSUPPORTED])
def test_each_unsupported_flag_is_refused_in_one_line(flag, attr, supported, why):
    wrong = True if supported in (False, None) else supported + 1
    with pytest.raises(SettingsError) as info:
        plugin.validate(_args(**{attr: wrong}), None)
    message = str(info.value)
    shown = flag if wrong is True else f"{flag} {wrong}"
    assert message.startswith(f"cpu: {shown} is not supported on the host ({why}). Fix: "), message
    assert "\n" not in message


def test_the_plugin_declares_the_check():
    assert plugin.PLUGIN.validate == "slime_ascend.cpu.plugin.validate"

"""The ``npu`` plugin's two MindSpeed adaptations (``train.npu_tensor_type``, ``train.npu_cuda_rng_state``) refuse a
target that no longer looks as checked, in one line; they run on the emulated device in
tests/npu_emulation/emulated_megatron_checks.py and in slime's loop in tests/e2e/test_slime_npu_emulated.py."""

from __future__ import annotations

import types

import pytest

from conftest import need
from slime_ascend.patch.base import PatchTargetError
from slime_ascend.patch.train import npu_cuda_rng_state, npu_tensor_type


def test_type_wrapper_reads_npu_as_cuda_and_leaves_conversions_alone():
    wrapped = npu_tensor_type.cuda_type_string(lambda *a, **k: "torch.npu.BFloat16Tensor" if not a[1:] else a[1])
    assert wrapped(object()) == "torch.cuda.BFloat16Tensor"
    sentinel = object()
    assert wrapped(object(), sentinel) is sentinel


def test_tensor_type_refuses_a_torch_without_the_npu_backend():
    need("megatron.core")
    with pytest.raises(PatchTargetError, match="PrivateUse1 backend is 'privateuseone', not 'npu'"):
        npu_tensor_type.PATCH.install()  # this pytest process never loads torch_npu
    assert not npu_tensor_type.PATCH.applied


def test_rng_state_refuses_a_megatron_that_no_longer_indexes_cuda_default_generators():
    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        return torch_npu_generators[0]  # noqa: F821 - never called: only its source is read

    fake = types.ModuleType(npu_cuda_rng_state.TARGET)
    fake._set_cuda_rng_state = _set_cuda_rng_state
    fake._lazy_call = lambda cb: cb()
    problems = npu_cuda_rng_state.PATCH.check({npu_cuda_rng_state.TARGET: fake})
    assert any("no longer contains 'torch.cuda.default_generators[idx]'" in p for p in problems), problems


def test_device_arch_version_is_mindspeeds_8_and_refuses_a_binding_that_moved():
    from slime_ascend.patch.train import npu_device_arch_version as arch

    def original():
        return torch_cuda_get_device_properties(0).major  # noqa: F821 - never called: only its source is read

    original.__qualname__ = "get_device_arch_version"
    original.__doc__ = "get_device_properties(...).major"
    modules = {name: types.ModuleType(name) for name in arch.BINDINGS}
    for module in modules.values():
        module.get_device_arch_version = original
    assert arch.PATCH.check(modules) == []
    modules["megatron.training.arguments"].get_device_arch_version = lambda: 9  # arguments.py stopped importing it
    assert arch.PATCH.check(modules) == ["megatron.training.arguments no longer bind the function "
                                         "megatron.training.utils.common_utils defines"]
    assert arch.get_device_arch_version() == 8

"""driver.allgather_cp_local_spec: slime's own DSA-only check of --allgather-cp is skipped for the cpu plugin's layer
spec only; with any other spec slime still refuses a dense model."""

import types

import pytest

pytestmark = pytest.mark.slime

CPU_SPEC = ["slime_ascend.cpu.spec", "get_layer_spec"]


def _args(spec):
    return types.SimpleNamespace(allgather_cp=True, context_parallel_size=2, spec=spec)


def test_the_check_is_skipped_for_the_cpu_spec_only(fresh_runtime):
    from slime_ascend.compat import typing_override

    typing_override.ensure()  # megatron-core >= 0.17 on Python 3.11 (slime's arguments imports Megatron's training)
    from slime_ascend.patch.driver.allgather_cp_local_spec import PATCH

    import slime.backends.megatron_utils.arguments as arguments

    dense = types.SimpleNamespace(architectures=["Qwen3ForCausalLM"])
    with pytest.raises(ValueError, match="only supported for"):  # slime's check, before the patch
        arguments._validate_allgather_cp_supported(_args(CPU_SPEC), dense)
    assert PATCH.verify() == []
    PATCH.install()
    try:
        assert arguments._validate_allgather_cp_supported(_args(CPU_SPEC), dense) is None
        with pytest.raises(ValueError, match="only supported for"):
            arguments._validate_allgather_cp_supported(_args(["my.spec", "layer_spec"]), dense)
        with pytest.raises(ValueError, match="only supported for"):
            arguments._validate_allgather_cp_supported(_args(None), dense)
    finally:
        PATCH.remove()
    with pytest.raises(ValueError, match="only supported for"):
        arguments._validate_allgather_cp_supported(_args(CPU_SPEC), dense)

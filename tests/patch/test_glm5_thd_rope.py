"""train.glm5_thd_rope: apex's THD RoPE importable only while slime's GLM-5 attention projects, only without apex."""

from __future__ import annotations

import sys

import pytest

from slime_ascend.glm5.ops import fused_apply_rotary_pos_emb_thd
from slime_ascend.patch.train import glm5_thd_rope


def test_the_stand_in_exists_only_inside_the_block_and_is_the_torch_rope():
    if "apex" in sys.modules:
        pytest.fail("apex is imported in this test process; the stand-in is for hosts without it")
    with glm5_thd_rope.host_apex_rope():
        from apex.transformer.functional import fused_apply_rotary_pos_emb_thd as found

        assert found is fused_apply_rotary_pos_emb_thd
    assert not [name for name in glm5_thd_rope.APEX if name in sys.modules]
    with pytest.raises(ImportError):
        import apex  # noqa: F401


def test_the_stand_in_is_removed_when_the_method_raises():
    class Attention:
        def get_absorb_query_key_value_tensors(self):
            import apex.transformer.functional  # noqa: F401

            raise RuntimeError("boom")

    wrapped = glm5_thd_rope._with_host_rope(Attention.get_absorb_query_key_value_tensors)
    with pytest.raises(RuntimeError, match="boom"):
        wrapped(Attention())
    assert "apex" not in sys.modules


def test_an_installed_apex_is_left_alone(monkeypatch):
    monkeypatch.setattr("slime_ascend.host.module_installed", lambda name: name == "apex")
    with glm5_thd_rope.host_apex_rope():
        assert "apex.transformer.functional" not in sys.modules

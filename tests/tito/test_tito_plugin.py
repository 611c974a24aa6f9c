"""The tito declaration: its slots, orders, and loadable hook paths."""

from __future__ import annotations

from slime_ascend.plugins import registry
from slime_ascend.tito.plugin import TITO


def test_tito_declares_its_slots_and_loads_from_entry_points():
    assert {c.slot for c in TITO.contributions} == {"rollout_sample_hook", "reward_post_process", "megatron_init",
                                                    "rollout_data_postprocess"}
    assert {c.order for c in TITO.contributions} == {900}
    for c in TITO.contributions:
        assert callable(c.load())
    assert registry.available()["tito"] is TITO

"""Declarations of the three sync plugins: they load, conflict, and contribute as documented."""

from __future__ import annotations

import pytest

from slime_ascend.plugins import registry
from slime_ascend.plugins.base import resolve
from slime_ascend.weight_sync import plugin as plugins


def test_plugins_are_registered_and_resolve():
    available = registry.available()
    for p in plugins.PLUGINS:
        assert available[p.name] is p or available[p.name].name == p.name
        slots = {c.slot: c for c in p.contributions}
        assert set(slots) == {"quantize_params", "megatron_init"}
        assert slots["megatron_init"].order == 300
        for c in p.contributions:
            assert callable(c.load())
        assert set(p.patch_ids) == {"train.quantize_params", "train.quant_post_process", "train.weight_sync_metrics",
                                    "driver.acknowledged_weight_update", "driver.acknowledged_collective_update",
                                    "train.gloo_float8_broadcast", "train.pipelined_weight_send",
                                    "driver.resumed_weight_version"}


@pytest.mark.parametrize("pair", [("fp8-sync", "int8-sync"), ("int8-sync", "int4-sync"), ("fp8-sync", "int4-sync")])
def test_plugins_conflict(pair, fresh_runtime):
    with pytest.raises(Exception, match="conflict"):
        registry.resolve_selection(list(pair))


def test_single_plugin_selects(fresh_runtime):
    sel = registry.resolve_selection(["int8-sync"])
    assert [p for p, _ in sel.slots["quantize_params"]] == ["int8-sync"]


def test_settings_defaults():
    keys = {s.key: s.default for p in plugins.PLUGINS for s in p.settings}
    assert keys["ascend_int4_sync_numerics"] == "compressed-tensors"
    assert keys["ascend_int8_sync_format"] == "auto"
    assert all(keys[f"ascend_{n}_check_engine_format"] for n in ("fp8_sync", "int8_sync", "int4_sync"))


def test_entry_point_targets():
    assert resolve("slime_ascend.weight_sync.plugin:FP8_SYNC") is plugins.FP8_SYNC
    assert resolve("slime_ascend.weight_sync.plugin:INT4_SYNC") is plugins.INT4_SYNC

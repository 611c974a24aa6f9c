"""The dis / icepop / staleness declarations: their slots, orders, and loadable hook paths."""

from __future__ import annotations

from slime_ascend.offpolicy.plugin import DIS, ICEPOP, STALENESS
from slime_ascend.plugins import registry

PLUGINS = {p.name: p for p in (DIS, ICEPOP, STALENESS)}


def test_plugins_declare_slots_orders_and_load_from_entry_points():
    assert {c.slot: c.order for c in DIS.contributions} == {"tis": 100}
    assert {c.slot: c.order for c in ICEPOP.contributions} == {"tis": 200}
    assert {c.slot: c.order for c in STALENESS.contributions} == {"reward_post_process": 100}
    for p in PLUGINS.values():
        for c in p.contributions:
            assert callable(c.load())
    available = registry.available()
    for name in PLUGINS:
        assert available[name] is PLUGINS[name]

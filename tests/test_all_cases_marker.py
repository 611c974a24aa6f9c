"""Cases marked ``all_cases`` (another case covers their evidence) leave the default set as *deselected*, not
skipped (on CI a skip fails the run), and come back with ``SLIME_ASCEND_ALL_CASES=1``."""

from __future__ import annotations

import pytest

import conftest


class _Item:
    def __init__(self, name: str, *marks: str):
        self.name, self.marks = name, marks

    def get_closest_marker(self, name: str):
        return pytest.mark.__getattr__(name) if name in self.marks else None


class _Config:
    def __init__(self):
        self.deselected = []
        self.hook = self

    def pytest_deselected(self, items):
        self.deselected.extend(items)


@pytest.mark.parametrize("all_cases, kept", [(None, ["a", "c"]), ("1", ["a", "b", "c"]), ("0", ["a", "c"])])
def test_all_cases_items_are_deselected_unless_asked(monkeypatch, all_cases, kept):
    if all_cases is None:
        monkeypatch.delenv("SLIME_ASCEND_ALL_CASES", raising=False)
    else:
        monkeypatch.setenv("SLIME_ASCEND_ALL_CASES", all_cases)
    items = [_Item("a"), _Item("b", "all_cases"), _Item("c", "slow")]
    config = _Config()
    conftest.pytest_collection_modifyitems(config, items)
    assert [item.name for item in items] == kept
    assert [item.name for item in config.deselected] == ([] if "b" in kept else ["b"])

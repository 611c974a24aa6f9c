"""After a push over a collective, every engine's served version is read back
(slime_ascend.weight_sync.pushed_version): one numeric version, newer than the last, or one line naming each
engine."""

from __future__ import annotations

import pytest

from _fake_engines import Engine, get
from slime_ascend.weight_sync.acknowledged import WeightUpdateError
from slime_ascend.weight_sync.pushed_version import acknowledge_push


def test_every_engine_on_the_pushed_version_is_acknowledged():
    assert acknowledge_push([Engine("3"), Engine("3")], get, previous=2, deadline_s=5) == 3
    assert acknowledge_push([Engine("1")], get, previous=None) == 1


def test_an_engine_left_behind_is_named():
    with pytest.raises(WeightUpdateError, match=r"engine 0: 3; engine 1: 2\).*broke off"):
        acknowledge_push([Engine("3"), Engine("2")], get, previous=2)


def test_no_switch_at_all_is_refused():
    with pytest.raises(WeightUpdateError, match="still serves version 2 .*last acknowledged was 2"):
        acknowledge_push([Engine("2")], get, previous=2)
    with pytest.raises(WeightUpdateError, match="engine 0: default"):
        acknowledge_push([Engine("default")], get, previous=None)


def test_an_engine_that_cannot_answer_is_named():
    class Silent(Engine):
        def _get_weight_version(self):
            raise TimeoutError("GetTimeoutError: no answer within 5 s")

    with pytest.raises(WeightUpdateError, match="engine 1: no version read back .*no answer within 5 s"):
        acknowledge_push([Engine("3"), Silent()], get, previous=2)

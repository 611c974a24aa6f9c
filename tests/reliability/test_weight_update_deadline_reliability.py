"""An engine that never answers a weight update: the acknowledged switch has a deadline, not a hang.

Replays the hang of issue 29 (one silent engine left every engine paused for ever) on engines whose calls
really block: each fake engine is a thread pool, ``get(ref, timeout=s)`` waits on a future as ``ray.get``
does. The silent engine's call never returns (until the test releases it)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import pytest

from slime_ascend.plugins.registry import available
from slime_ascend.plugins.settings import SettingsError, coerce
from slime_ascend.weight_sync.acknowledged import (WEIGHT_UPDATE_DEADLINE, Served, WeightUpdateError, initial_served,
                                                   require_serving, switch_all_or_none)


def get(ref, timeout=None):
    try:
        return ref.result(timeout=timeout)
    except FutureTimeout:
        raise TimeoutError(f"no answer within {timeout} s") from None


class BlockingEngine:
    """One call at a time, like slime's SGLangEngine actor (a call waits behind the one running)."""

    def __init__(self, silent_on: set[str] = frozenset(), dead: bool = False):
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.silent_on, self.dead = set(silent_on), dead
        self.release = threading.Event()
        self.version, self.paused, self.log = "1", False, []
        for name in ("pause_generation", "continue_generation", "flush_cache", "update_weights_from_disk",
                     "get_weight_version"):
            setattr(self, name, _Method(self, name))

    def run(self, name, **kwargs):
        self.log.append(name)
        if self.dead:
            raise ConnectionError("Connection refused")
        if name in self.silent_on:
            self.release.wait()
        if name == "pause_generation":
            self.paused = True
        elif name == "continue_generation":
            self.paused = False
        elif name == "update_weights_from_disk":
            self.version = str(kwargs["weight_version"])
            return {"success": True}
        elif name == "get_weight_version":
            return self.version
        return None


class _Method:
    def __init__(self, engine, name):
        self.engine, self.name = engine, name

    def remote(self, **kwargs):
        return self.engine.pool.submit(self.engine.run, self.name, **kwargs)


@pytest.fixture
def fleet():
    engines = []
    yield engines
    for engine in engines:
        engine.release.set()
        engine.pool.shutdown(wait=True)


def test_a_silent_engine_is_left_out_after_the_deadline_and_the_others_resume(fleet):
    fleet += [BlockingEngine(), BlockingEngine(silent_on={"update_weights_from_disk"}), BlockingEngine()]
    start = time.monotonic()
    with pytest.raises(WeightUpdateError) as err:
        switch_all_or_none(fleet, get, "/w/v2", "2", Served("1", "/w/v1"), deadline_s=0.5)
    took = time.monotonic() - start
    message = str(err.value)
    assert "\n" not in message
    assert message == (
        "weight version 2 was not taken by every engine (engine 1: no answer to update_weights_from_disk within "
        "0.5 s); engines 0, 2 back on version 1 and generating; engine 1 did not answer and is not acknowledged on "
        "any version. Fix: restart engine 1 (or look at its log) before training on"), message
    assert took < 5, took  # the deadline, then the others' roll-back: nothing waits for the silent engine
    for engine in (fleet[0], fleet[2]):
        assert engine.version == "1" and not engine.paused
        assert engine.log == ["pause_generation", "flush_cache", "update_weights_from_disk", "get_weight_version",
                              "get_weight_version", "update_weights_from_disk", "get_weight_version",
                              "continue_generation"], engine.log
    # the silent engine was asked nothing after the load it sits in, except a continue sent without waiting
    fleet[1].release.set()
    fleet[1].pool.shutdown(wait=True)
    assert fleet[1].log == ["pause_generation", "flush_cache", "update_weights_from_disk", "continue_generation"]
    assert not fleet[1].paused  # it resumed once the call it was stuck in returned


def test_an_engine_silent_at_pause_and_a_dead_one_are_named_each(fleet):
    fleet += [BlockingEngine(), BlockingEngine(dead=True), BlockingEngine(silent_on={"pause_generation"})]
    with pytest.raises(WeightUpdateError) as err:
        switch_all_or_none(fleet, get, "/w/v2", "2", Served("1", "/w/v1"), deadline_s=0.3)
    message = str(err.value)
    assert message.startswith("weight version 2 was not taken by every engine (engine 1: pause_generation: "
                              "Connection refused; engine 2: no answer to pause_generation within 0.3 s); engine 0 "
                              "back on version 1 and generating; engines 1, 2 did not answer"), message
    assert fleet[0].version == "1" and not fleet[0].paused
    assert "update_weights_from_disk" not in fleet[2].log  # never asked to load


def test_read_backs_have_the_deadline_too(fleet):
    fleet += [BlockingEngine(), BlockingEngine(silent_on={"get_weight_version"})]
    assert initial_served(fleet, get, "/ckpt", deadline_s=0.3) is None
    with pytest.raises(WeightUpdateError, match=r"engine 1: no answer to get_weight_version within 0\.3 s$"):
        require_serving(fleet, get, "1", deadline_s=0.3)


def test_every_answer_in_time_is_acknowledged_as_before(fleet):
    fleet += [BlockingEngine(), BlockingEngine()]
    assert switch_all_or_none(fleet, get, "/w/v2", "2", Served("1", "/w/v1"), deadline_s=5) == Served("2", "/w/v2")
    assert all(e.version == "2" and not e.paused for e in fleet)


def test_the_deadline_is_a_staleness_setting_with_a_sane_default():
    assert WEIGHT_UPDATE_DEADLINE.default == 600.0
    assert WEIGHT_UPDATE_DEADLINE in available()["staleness"].settings
    with pytest.raises(SettingsError, match="ascend_weight_update_deadline_s"):
        coerce(WEIGHT_UPDATE_DEADLINE, 0)


def test_an_engine_that_does_not_resume_fails_the_update(fleet):
    fleet += [BlockingEngine(), BlockingEngine(silent_on={"continue_generation"})]
    with pytest.raises(WeightUpdateError, match=r"^weight version 2 was acknowledged, but generation did not resume "
                                                r"on engine 1: no answer to continue_generation within 0\.3 s\."):
        switch_all_or_none(fleet, get, "/w/v2", "2", Served("1", "/w/v1"), deadline_s=0.3)
    assert not fleet[0].paused

"""All-or-none, acknowledged weight switches (slime_ascend.weight_sync.acknowledged) on fake engines."""

from __future__ import annotations

import pytest

from _fake_engines import Engine, get

from slime_ascend.weight_sync.acknowledged import Served, WeightUpdateError, initial_served, switch_all_or_none


def test_every_engine_switches_and_is_read_back():
    engines = [Engine(), Engine()]
    served = switch_all_or_none(engines, get, "/w/v1", "1", Served("default", "/ckpt"))
    assert served == Served("1", "/w/v1")
    assert [e.version for e in engines] == ["1", "1"]
    assert all(e.log == ["pause", "flush", "load 1", "continue"] for e in engines)


@pytest.mark.parametrize("failure", ["raises", "success_false", "serves_another_version"])
def test_one_failing_engine_returns_every_engine_to_the_acknowledged_version(failure):
    bad = {"raises": Engine(broken=("/w/v2",)), "success_false": Engine(answer_false=("/w/v2",)),
           "serves_another_version": Engine()}[failure]
    good = Engine()
    engines = [good, bad]
    previous = switch_all_or_none(engines, get, "/w/v1", "1", Served("default", "/ckpt"))
    bad.lies = failure == "serves_another_version"  # answers success, keeps serving version 1
    with pytest.raises(WeightUpdateError) as err:
        switch_all_or_none(engines, get, "/w/v2", "2", previous)
    message = str(err.value)
    assert "\n" not in message and "engine 1:" in message and "engine 0" not in message.split("back on")[0]
    assert "every engine is back on version 1" in message
    assert [e.version for e in engines] == ["1", "1"] and good.path == "/w/v1"
    assert all(not e.paused and e.log[-1] == "continue" for e in engines)  # generation resumed


def test_no_earlier_version_and_a_failed_return_are_said():
    engines = [Engine(), Engine(broken=("/w/v1",))]
    with pytest.raises(WeightUpdateError, match="no acknowledged earlier version"):
        switch_all_or_none(engines, get, "/w/v1", "1", None)
    engines = [Engine(broken=("/ckpt",)), Engine(broken=("/w/v1",))]
    with pytest.raises(WeightUpdateError, match="failed too .*restart them"):
        switch_all_or_none(engines, get, "/w/v1", "1", Served("default", "/ckpt"))
    assert all(not e.paused for e in engines)


def test_initial_served_is_the_common_version_or_none():
    assert initial_served([Engine(), Engine()], get, "/ckpt") == Served("default", "/ckpt")
    assert initial_served([Engine(), Engine(version="3")], get, "/ckpt") is None


def test_only_the_engines_that_moved_are_sent_back():
    """An engine that refused the load kept its weights: it is not asked to reload the previous version
    (it may have started on another checkpoint than the others)."""
    good, refusing = Engine(), Engine(path="/other", broken=("/w/v1", "/ckpt"))
    with pytest.raises(WeightUpdateError, match="every engine is back on version default"):
        switch_all_or_none([good, refusing], get, "/w/v1", "1", Served("default", "/ckpt"))
    assert good.log == ["pause", "flush", "load 1", "load default", "continue"]
    assert refusing.log == ["pause", "flush", "load 1", "continue"] and refusing.path == "/other"


def test_an_engines_failure_is_its_own_one_line_cause():
    from slime_ascend.weight_sync.acknowledged import _one_line

    class Response:
        status_code = 400

        def json(self):
            return {"success": False, "error": "config.json of /w/v1 differs: intermediate_size 128 vs 96"}

    class HTTPError(Exception):
        response = Response()

    class RayTaskError(Exception):  # what ray.get raises: the traceback text, the original as .cause
        def __init__(self):
            super().__init__("ray::SGLangEngine.update_weights_from_disk()\n  File ...\n    raise\n")
            self.cause = HTTPError("400 Client Error")

    assert _one_line(RayTaskError()) == "HTTP 400: config.json of /w/v1 differs: intermediate_size 128 vs 96"
    assert _one_line(RuntimeError("a\n  b")) == "a b"


def test_require_serving_names_each_engine_on_another_version():
    from slime_ascend.weight_sync.acknowledged import require_serving

    require_serving([Engine(version="4"), Engine(version="4")], get, 4)
    with pytest.raises(WeightUpdateError, match=r"not served by every engine: engine 1: serves version 3$"):
        require_serving([Engine(version="4"), Engine(version="3")], get, "4")

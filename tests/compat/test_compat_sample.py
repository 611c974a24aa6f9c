"""Sample compatibility: slime's class when importable, the documented stand-in otherwise."""

from dataclasses import fields
from types import SimpleNamespace

import pytest

from conftest import SLIME
from slime_ascend.compat.sample import FallbackSample, get_sample_class

STATUS_VALUES = {"PENDING": "pending", "COMPLETED": "completed", "TRUNCATED": "truncated",
                 "ABORTED": "aborted", "FAILED": "failed"}


def test_fallback_status_reward_and_round_trip():
    assert {m.name: m.value for m in FallbackSample.Status} == STATUS_VALUES
    s = FallbackSample(index=2, tokens=[1, 2, 3], response_length=2, loss_mask=[1, 0], reward={"acc": 0.5})
    assert s.status is FallbackSample.Status.PENDING and s.rollout_id is None
    assert s.get_reward_value(SimpleNamespace(reward_key="acc")) == 0.5
    assert FallbackSample(reward=1.0).get_reward_value(SimpleNamespace(reward_key=None)) == 1.0
    assert s.effective_response_length == 1
    s.extra = "kept"
    back = FallbackSample.from_dict(s.to_dict())
    assert back == s and back.extra == "kept" and back.to_dict()["status"] == "pending"


def test_get_sample_class_matches_environment():
    if SLIME:  # slime's Sample wherever slime is on the path (slime.utils.types needs nothing beyond torch)
        from slime.utils.types import Sample
    else:
        Sample = FallbackSample
    assert get_sample_class() is Sample


@pytest.mark.slime
def test_fallback_mirrors_slime_field_names_and_defaults():
    import slime.utils.types as types

    slime_fields = {f.name: f for f in fields(types.Sample)}
    ours = FallbackSample()
    theirs = types.Sample()
    for f in fields(FallbackSample):
        assert f.name in slime_fields, f"{f.name} is not a slime Sample field"
        if f.name != "status":
            assert getattr(ours, f.name) == getattr(theirs, f.name), f.name
    assert {m.name: m.value for m in types.Sample.Status} == STATUS_VALUES

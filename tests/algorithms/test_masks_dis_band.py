"""resolve_dis_band: the one reader of a DIS band configuration (dis plugin and sao plugin)."""

from __future__ import annotations

import math

import pytest

from slime_ascend.algorithms.masks import DIS_PRESETS, DISBand, resolve_dis_band


@pytest.mark.parametrize("preset", sorted(DIS_PRESETS))
def test_presets(preset):
    assert resolve_dis_band(preset, None, None, "ascend_dis_") == DIS_PRESETS[preset]


def test_custom_needs_both_positive_finite_eps_and_names_the_key():
    assert resolve_dis_band("custom", 0.1, 0.5, "ascend_sao_dis_") == DISBand(0.1, 0.5)
    for low, high, bad in ((None, 0.5, "ascend_sao_dis_eps_low"), (0.1, 0.0, "ascend_sao_dis_eps_high"),
                           (0.1, math.inf, "ascend_sao_dis_eps_high"), (-1.0, 0.5, "ascend_sao_dis_eps_low")):
        with pytest.raises(ValueError, match=bad):
            resolve_dis_band("custom", low, high, "ascend_sao_dis_")


def test_eps_with_a_named_preset_or_an_unknown_preset_is_an_error():
    with pytest.raises(ValueError, match="ascend_dis_preset: custom"):
        resolve_dis_band("maths", 0.1, None, "ascend_dis_")
    with pytest.raises(ValueError, match="ascend_dis_preset='math'"):
        resolve_dis_band("math", None, None, "ascend_dis_")

"""Teachers one engine switches between are one architecture, checked at start from config.json and the
safetensors headers (:mod:`slime_ascend.opd.shared_engine`; refused at parse_args by the opd plugin)."""

from __future__ import annotations

import json
import types

import pytest
import torch
from safetensors.torch import save_file
from teacher_fixtures import teachers  # noqa: F401  (pytest fixture)

from slime_ascend.opd.hooks import _validate_shared_engine
from slime_ascend.opd.shared_engine import architecture_mismatch
from slime_ascend.opd.teachers import parse_teachers
from slime_ascend.plugins.settings import SettingsError


def _other(root, name, hidden=12, config=None, drop=None):
    """A teacher like the fixtures' but with ``hidden`` units, its own config.json, without tensor ``drop``."""
    d = root / name
    d.mkdir()
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 16))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != drop}
    save_file(state, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(config or {"vocab_size": 16}))
    return d


def test_teachers_of_one_architecture_pass(teachers):
    _, dirs, _ = teachers
    assert architecture_mismatch(list(dirs.items())) is None


def test_a_tensor_of_another_shape_is_named_with_both_teachers(teachers, tmp_path):
    _, dirs, _ = teachers
    wide = _other(tmp_path, "wide", hidden=24)
    why = architecture_mismatch([("math", dirs["math"]), ("wide", wide)])
    assert why == (f"tensor 0.bias is [12] in 'math' ({dirs['math']}) and [24] in 'wide' ({wide})")


def test_a_missing_tensor_and_another_model_type_are_named(teachers, tmp_path):
    _, dirs, _ = teachers
    short = _other(tmp_path, "short", drop="2.bias")
    assert "tensor 2.bias is [16] in 'math'" in architecture_mismatch([("math", dirs["math"]), ("short", short)])
    assert architecture_mismatch([("short", short), ("math", dirs["math"])]).startswith("tensor 2.bias is missing")
    typed = _other(tmp_path, "typed", config={"vocab_size": 16, "model_type": "glm_moe_dsa"})
    assert architecture_mismatch([("math", dirs["math"]), ("typed", typed)]) == (
        f"config.json model_type is None in 'math' ({dirs['math']}) and 'glm_moe_dsa' in 'typed' ({typed})")


def test_a_teacher_without_checkpoint_files_is_left_to_the_pool(teachers, tmp_path):
    _, dirs, _ = teachers
    (tmp_path / "empty").mkdir()
    assert architecture_mismatch([("math", dirs["math"]), ("empty", tmp_path / "empty"),
                                  ("code", dirs["code"])]) is None


def test_parse_args_refuses_switched_teachers_of_two_architectures_in_one_line(teachers, tmp_path):
    specs, dirs, _ = teachers
    wide = _other(tmp_path, "wide", hidden=24)
    settings = {"ascend_opd_switch_engine_urls": ["http://127.0.0.1:30001"], "ascend_opd_switch_transport": "disk",
                "ascend_opd_stage_dir": None}
    args = types.SimpleNamespace()
    _validate_shared_engine(args, settings, parse_teachers(specs))  # one architecture: passes
    mixed = parse_teachers(specs + [{"name": "wide", "checkpoint_dir": str(wide), "domains": ["wide"]}])
    with pytest.raises(SettingsError) as err:
        _validate_shared_engine(args, settings, mixed)
    message = str(err.value)
    assert "\n" not in message and "'math'" in message and "'wide'" in message and "Fix: give that teacher" in message
    # a teacher with its own engine (url), or hosted by slime's own router, is not switched: no check
    own = parse_teachers(specs + [{"name": "wide", "checkpoint_dir": str(wide), "domains": ["wide"],
                                   "url": "http://127.0.0.1:30002"}])
    _validate_shared_engine(args, settings, own)
    _validate_shared_engine(types.SimpleNamespace(sglang_model_routers={"wide": "x"}), settings, mixed)
    _validate_shared_engine(args, {"ascend_opd_switch_engine_urls": []}, mixed)  # no pool-switched engine


@pytest.mark.parametrize("transport", ["distributed", "tensor"])
def test_a_stage_dir_with_a_host_memory_transport_is_refused_in_one_line(teachers, tmp_path, transport):
    specs, _, _ = teachers
    settings = {"ascend_opd_switch_engine_urls": ["http://127.0.0.1:30001"], "ascend_opd_switch_transport":
                transport, "ascend_opd_stage_dir": str(tmp_path / "stage")}
    with pytest.raises(SettingsError) as err:
        _validate_shared_engine(types.SimpleNamespace(), settings, parse_teachers(specs))
    assert "\n" not in str(err.value) and "Fix: unset ascend_opd_stage_dir" in str(err.value)
    _validate_shared_engine(types.SimpleNamespace(), {**settings, "ascend_opd_stage_dir": None},
                            parse_teachers(specs))  # host-memory staging: passes

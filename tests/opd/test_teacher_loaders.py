"""The in-process teacher loaders (:mod:`slime_ascend.opd.loaders`), driven through a TeacherPool."""

from __future__ import annotations

import torch
from teacher_fixtures import teachers, tiny_model, weights_of  # noqa: F401  (teachers: fixture)

from slime_ascend.opd.loaders import TorchModuleLoader, WeightDictLoader
from slime_ascend.opd.pool import TeacherPool


def test_weight_dict_loader_swaps_in_place(teachers):
    specs, dirs, student = teachers
    model = tiny_model()
    live = dict(model.named_parameters())
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    with TeacherPool(specs, WeightDictLoader(live), student_dir=student) as pool:
        pool.activate("code")
        for k, v in weights_of(dirs["code"]).items():
            assert torch.equal(live[k].detach(), v) and live[k].data_ptr() == ptrs[k]


def test_copy_mode_keeps_parameters_and_old_weights_are_freed_in_background(teachers):
    import weakref

    specs, dirs, student = teachers
    model = tiny_model()
    ptr = model[0].weight.data_ptr()
    with TeacherPool(specs, TorchModuleLoader(model, mode="copy"), student_dir=student) as pool:
        pool.activate("math")
        assert model[0].weight.data_ptr() == ptr  # copy_ into the resident parameters
        assert torch.equal(model[0].weight.detach(), weights_of(dirs["math"])["0.weight"])
    assert TorchModuleLoader(tiny_model()).pin is False  # CPU: never pinned
    model = tiny_model()
    with TeacherPool(specs, TorchModuleLoader(model), student_dir=student) as pool:  # CPU assign
        pool.activate("math")
        old = weakref.ref(model[0].weight)
        pool.activate("code")
        pool._executor.submit(lambda: None).result(5)  # drain the background queue
        assert old() is None
        assert torch.equal(model[0].weight.detach(), weights_of(dirs["code"])["0.weight"])

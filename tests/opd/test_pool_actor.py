"""TeacherPoolService and its Ray actor class (:mod:`slime_ascend.opd.pool_actor`)."""

from __future__ import annotations

import pytest
from teacher_fixtures import teachers, tiny_model  # noqa: F401  (teachers: fixture)

from slime_ascend.opd.loaders import TorchModuleLoader
from slime_ascend.opd.pool_actor import TeacherPoolService, make_teacher_pool_actor


def test_service_and_ray_actor_class(teachers):
    specs, _, student = teachers
    svc = TeacherPoolService(specs, lambda: TorchModuleLoader(tiny_model()), student_dir=str(student))
    assert svc.activate("math")["teacher"] == "math" and svc.active() == "math"
    assert svc.metrics()["switches"] == 1
    svc.close()
    pytest.importorskip("ray", reason="ray not installed")
    actor_cls = make_teacher_pool_actor(num_cpus=0)
    assert hasattr(actor_cls, "remote")

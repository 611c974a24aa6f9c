"""The npu accelerator, exercised through slime's real registry on the devices present."""

import json

import pytest
import torch

from conftest import run_python
from slime_ascend.accelerator import npu

pytestmark = pytest.mark.slime


def test_registered_in_fresh_interpreter_with_variable():
    proc = run_python(
        "import json; from slime.utils import accelerator as a;"
        "r = a._REGISTRY['npu']; print(json.dumps([r.priority, list(r.communication_backends), r.is_available()]))",
        env={"SLIME_ASCEND_PLUGINS": "npu"},
    )
    assert proc.returncode == 0, proc.stderr
    priority, backends, available = json.loads(proc.stdout.strip().splitlines()[-1])
    assert priority > 100 and backends == ["hccl"]
    assert available is npu.is_npu_available()


def test_not_registered_without_variable():
    proc = run_python("from slime.utils import accelerator as a; print('npu' in a._REGISTRY)")
    assert proc.stdout.strip().splitlines()[-1] == "False"


def test_cpu_host_selection_is_unchanged():
    """On a host without NPU (and without CUDA) slime still finds no accelerator: nothing is forced."""
    proc = run_python(
        "from slime.utils import accelerator as a; import torch;"
        "print(a.initialize_accelerator() is None or torch.cuda.is_available())",
        env={"SLIME_ASCEND_PLUGINS": "npu"},
    )
    assert proc.stdout.strip().splitlines()[-1] == "True"


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.device
@pytest.mark.parametrize("device_type", DEVICES)
def test_same_class_runs_on_present_devices(device_type):
    from slime.utils.accelerator.base import Accelerator

    acc = npu.accelerator_class(device_type)()
    assert isinstance(acc, Accelerator)
    assert acc.is_available()
    assert acc.visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert acc.device(0) == torch.device(f"{device_type}:0")
    assert acc.device_name("3") == f"{device_type}:3"
    assert isinstance(acc.current_device(), int)
    assert acc.device_count() >= 1
    acc.synchronize()
    assert acc.ray_resource_name() == "NPU"
    assert acc.supports("torch_compile") is False
    assert acc.distributed_device_id(0) is None


def test_npu_class_constants():
    cls = npu.accelerator_class("npu")
    assert cls.name == "npu" and cls.communication_backend_name == "hccl"
    assert npu.PRIORITY > 200  # above musa and cuda


def test_weight_update_backend_is_hccl():
    cls = npu.accelerator_class("npu")
    acc = cls.__new__(cls)  # no torch_npu here: skip __init__, test the pure methods
    acc.device_type = "npu"
    assert acc.communication_backend("nccl") == "hccl"
    assert acc.weight_update_backend("nccl") == "hccl"
    assert acc.communication_backend("gloo") == "gloo"

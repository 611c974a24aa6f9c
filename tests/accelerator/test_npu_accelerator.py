"""The npu accelerator, exercised through slime's real registry on the devices present."""

import json

import pytest
import torch

from conftest import run_python
from slime_ascend.accelerator import npu

pytestmark = pytest.mark.slime


@pytest.fixture(scope="module")
def npu_only_interpreter():
    """One fresh interpreter with ``SLIME_ASCEND_PLUGINS=npu`` (a Python start with slime and torch costs
    5-15 s on a 2-core host): slime's registry entry for npu as registered, then what slime's
    ``initialize_accelerator`` found on this host."""
    proc = run_python(
        "import json; from slime.utils import accelerator as a; import torch;"
        "r = a._REGISTRY['npu']; registered = [r.priority, list(r.communication_backends), r.is_available()];"
        "print(json.dumps({'registered': registered,"
        " 'host_unchanged': a.initialize_accelerator() is None or torch.cuda.is_available()}))",
        env={"SLIME_ASCEND_PLUGINS": "npu"},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_registered_in_fresh_interpreter_with_variable(npu_only_interpreter):
    priority, backends, available = npu_only_interpreter["registered"]
    assert priority > 100 and backends == ["hccl"]
    assert available is npu.is_npu_available()


def test_not_registered_without_variable():
    proc = run_python("from slime.utils import accelerator as a; print('npu' in a._REGISTRY)")
    assert proc.stdout.strip().splitlines()[-1] == "False"


def test_cpu_host_selection_is_unchanged(npu_only_interpreter):
    """On a host without NPU (and without CUDA) slime still finds no accelerator: nothing is forced."""
    assert npu_only_interpreter["host_unchanged"] is True


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the class over torch.cuda)")
@pytest.mark.parametrize("device_type", ["cuda"])
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


# --- npu on the host (plugins cpu,npu): the npu identity over the host's device operations -------------------


def test_host_class_has_the_npu_identity_and_the_hosts_device_ops(monkeypatch):
    from slime.utils.accelerator.base import Accelerator

    acc = npu.accelerator_class("cpu")()
    assert isinstance(acc, Accelerator) and acc.is_available()
    assert acc.name == "npu-as-cpu"
    # what makes it npu to slime
    assert acc.visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert acc.ray_resource_name() == "NPU"
    assert acc.distributed_device_id(0) is None
    assert acc.supports("torch_compile") is False and acc.supports("nvml_affinity") is False
    # what the host runs: gloo, the one host device, host memory, torch's RNG
    assert acc.communication_backend() == acc.communication_backend("hccl") == "gloo"
    assert acc.weight_update_backend() == "gloo"
    assert acc.device() == torch.device("cpu") and acc.current_device() == "cpu"
    avail, total = acc.mem_get_info()
    assert 0 <= avail <= total and total > 0
    acc.manual_seed(7)
    state = acc.get_rng_state()
    first = torch.rand(3)
    acc.set_rng_state(state)
    assert torch.equal(first, torch.rand(3))
    # slime's device-id rule under the variable Ray sets for NPU workers (the host class alone says 0)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,6")
    assert acc.resolve_visible_device_id("6") == 1 and acc.resolve_visible_device_id(4) == 0
    with pytest.raises(RuntimeError, match="ASCEND_RT_VISIBLE_DEVICES"):
        acc.resolve_visible_device_id(5)


def test_cpu_and_npu_select_npu_on_the_host_in_a_fresh_interpreter():
    proc = run_python(
        "import json; from slime.utils import accelerator as a; import slime.ray.placement_group as pg;"
        "acc = a.get_accelerator();"
        "print(json.dumps([acc.name, a._REGISTRY['npu'].communication_backends, a.process_group_backend(),"
        " type(pg.ray).__name__]))",
        env={"SLIME_ASCEND_PLUGINS": "cpu,npu"},
    )
    assert proc.returncode == 0, proc.stderr
    name, backends, backend, ray_view = json.loads(proc.stdout.strip().splitlines()[-1])
    # npu outranks cpu in slime's registry; the cpu plugin leaves Ray to npu's NPU view
    assert (name, backends, backend, ray_view) == ("npu-as-cpu", ["gloo"], "gloo", "NPURay")


def test_cpu_and_npu_together_are_refused_where_torch_npu_is_installed(monkeypatch):
    from slime_ascend import host
    from slime_ascend.cpu import plugin as cpu_plugin
    from slime_ascend.host import on_host
    from slime_ascend.plugins.registry import PluginError

    monkeypatch.setenv("SLIME_ASCEND_PLUGINS", "cpu,npu")
    monkeypatch.setattr(host, "torch_npu_installed", lambda: True)
    with pytest.raises(PluginError, match="drop 'cpu'"):
        on_host()
    with pytest.raises(PluginError, match="drop 'cpu'"):
        cpu_plugin.owns_ray()
    monkeypatch.setattr(host, "torch_npu_installed", lambda: False)
    assert on_host() is True and cpu_plugin.owns_ray() is False
    for alone in ("cpu", "npu"):
        monkeypatch.setenv("SLIME_ASCEND_PLUGINS", alone)
        assert on_host() is False
    assert cpu_plugin.owns_ray() is True

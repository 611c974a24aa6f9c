"""The cpu accelerator in slime's real registry (slime.utils.accelerator)."""

import json

import pytest
import torch

from conftest import run_python
from slime_ascend.cpu import accelerator as cpu_accelerator

pytestmark = pytest.mark.slime


@pytest.fixture
def registry(monkeypatch):
    """slime's accelerator module with ``cpu`` registered and selected by SLIME_ACCELERATOR; the
    registry entry, the selection and the environment are restored afterwards."""
    from slime.utils import accelerator as a

    a._register_builtin_backends()
    monkeypatch.setitem(a._REGISTRY, "cpu", a._REGISTRY["cuda"])  # recorded so teardown drops our entry
    for var in ("MUSA_VISIBLE_DEVICES", "MUSA_PATCH_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLIME_ACCELERATOR", "cpu")
    a.reset_accelerator()
    cpu_accelerator.register(a)
    try:
        yield a
    finally:
        a.reset_accelerator()


def test_register_puts_cpu_below_cuda(registry):
    entry = registry._REGISTRY["cpu"]
    assert entry.priority == cpu_accelerator.PRIORITY
    assert entry.priority < registry._REGISTRY["cuda"].priority == 100
    assert entry.communication_backends == ("gloo",)
    assert entry.is_available() is True
    cpu_accelerator.register(registry)  # idempotent
    assert registry._REGISTRY["cpu"].priority == entry.priority
    # without a request, a host with CUDA would pick cuda first
    order = [name for name, _ in sorted(registry._REGISTRY.items(), key=lambda i: (-i[1].priority, i[0]))]
    assert order.index("cuda") < order.index("cpu")


def test_get_accelerator_is_the_cpu_one(registry):
    from slime.utils.accelerator.base import Accelerator

    acc = registry.get_accelerator()
    assert isinstance(acc, Accelerator) and acc.name == "cpu"
    assert registry.device_name() == "cpu" and acc.device_name(0) == "cpu"
    assert registry.current_device() == "cpu"
    assert registry.device() == torch.device("cpu")
    assert registry.device_count() == 1
    assert registry.process_group_backend() == "gloo"
    assert registry.process_group_backend("hccl") == "gloo"
    assert registry.weight_update_backend() == "gloo"
    avail, total = registry.mem_get_info()
    assert isinstance(avail, int) and isinstance(total, int)
    assert 0 <= avail <= total and total > 0
    assert registry.resolve_visible_device_id(3) == 0
    assert registry.visible_devices_env_key() == cpu_accelerator.VISIBLE_DEVICES_ENV
    assert registry.distributed_device_id(0) is None
    assert registry.accelerator_module() is None
    assert registry.supports("requires_cpu_initialization") is True
    assert registry.supports("torch_compile") is False
    registry.synchronize()
    registry.empty_cache()
    state = registry.get_rng_state()
    registry.manual_seed(1234)
    first = torch.rand(2)
    registry.set_rng_state(state)
    registry.manual_seed(1234)
    assert torch.equal(torch.rand(2), first)
    assert registry.get_device_properties().total_memory == total


def test_reset_forgets_the_selection(registry):
    first = registry.get_accelerator()
    assert registry.get_accelerator() is first
    registry.reset_accelerator()
    assert registry.get_accelerator() is not first


def test_plugin_registers_in_fresh_interpreter():
    proc = run_python(
        "import json; from slime.utils import accelerator as a; r = a._REGISTRY['cpu'];"
        "print(json.dumps([r.priority, list(r.communication_backends)]))",
        env={"SLIME_ASCEND_PLUGINS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr
    priority, backends = json.loads(proc.stdout.strip().splitlines()[-1])
    assert priority < 100 and backends == ["gloo"]

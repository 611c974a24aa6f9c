"""train.reloadable_group_collectives: slime's ReloadableProcessGroup forwards the collectives torch 2.14 calls
by their new names (reduce_scatter_single, all_gather_single, all_to_all_single), in a subprocess with the cpu
plugin (slime's wrapper checks device memory through the accelerator) and a one-rank gloo group."""

import json

import pytest

from conftest import run_python

pytestmark = pytest.mark.slime

PROBE = r"""
import json, socket
import torch, torch.distributed as dist
from slime_ascend import patch
from slime.utils.reloadable_process_group import ReloadableProcessGroup, monkey_patch_torch_dist

# as Megatron's tensor_parallel.mappings does at import: the functions bound before slime's monkey patch of
# torch.distributed, which unwraps the group only in the functions it replaces
reduce_scatter_tensor, all_gather_into_tensor = dist.reduce_scatter_tensor, dist.all_gather_into_tensor
all_to_all_single = dist.all_to_all_single

with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
monkey_patch_torch_dist()
group = ReloadableProcessGroup(dist.new_group([0], backend="gloo"), [0], backend="gloo")
out = {"applied": patch.get("train.reloadable_group_collectives").applied}

def collectives():
    x = torch.arange(6.0)
    rs, ag, a2a = torch.empty(6), torch.empty(6), torch.empty(6)
    try:
        reduce_scatter_tensor(rs, x, group=group)
        all_gather_into_tensor(ag, x + 1, group=group)
        all_to_all_single(a2a, x + 2, group=group)
    except (RuntimeError, TypeError) as exc:
        return "raised: " + str(exc).splitlines()[0]
    return [rs.tolist(), ag.tolist(), a2a.tolist()]

out["collectives"] = collectives()
print(json.dumps(out), flush=True)
import os
os._exit(0)  # no interpreter teardown: the gloo groups' destructors can abort the process at exit (SIGABRT)
"""


def _probe(plugins: str | None) -> dict:
    proc = run_python(PROBE, env={"SLIME_ASCEND_PLUGINS": plugins} if plugins else None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_wrapper_forwards_the_new_collective_names():
    out = _probe("cpu")
    assert out["applied"] is True  # the cpu plugin declares it
    x = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert out["collectives"] == [x, [v + 1 for v in x], [v + 2 for v in x]], out


def test_without_the_patch_the_wrapper_has_no_backend():
    out = _probe(None)  # no plugin: slime's wrapper as it is
    assert out["applied"] is False
    assert out["collectives"].startswith("raised: No backend type associated with device type cpu"), out

"""train.routing_replay: slime's routing replay (slime.utils.routing_replay) wired into a stock Megatron-core, as
slime's own Megatron patch wires it. In a process with the cpu plugin (its accelerator: slime's replay moves the
routes to ``current_device()``), Megatron's own TopKRouter, built and run here, registers one slime RoutingReplay
and routes by slime's stage: record (Megatron's top-k, recorded), replay_forward / replay_backward (the recorded
routes, whatever the logits say; the weights softmax over the replayed experts' logits, as slime's patched
Megatron gives them) and fallthrough; without the patch the same stages route by the logits. An MTP layer's router
registers no replay and routes by its own logits while the decoder replays."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from slime_ascend import patch
from slime_ascend.cpu import plugin
from slime_ascend.patch.train import routing_replay

pytestmark = pytest.mark.slime
pytest.importorskip("megatron.core")
pytest.importorskip("slime.utils.routing_replay", reason="real slime is not on PYTHONPATH")

PATCH_ID = "train.routing_replay"
FORCED = [[0, 1], [2, 3], [1, 3], [0, 2], [3, 0]]  # experts of 5 tokens, top 2 of 4

PROBE = r"""
import json, os, socket, sys
import torch, torch.distributed as dist
keep = sys.argv[1] == "patched"
os.environ["ENABLE_ROUTING_REPLAY"] = "1"  # what slime's RayTrainGroup sets for the actor's train processes
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
from megatron.core import parallel_state as mpu
mpu.initialize_model_parallel(1, 1)
from slime_ascend import patch
for p in ("train.cpu_current_device", "train.cpu_device_map"):  # the cpu plugin's, as in a train actor
    if not patch.get(p).applied:
        patch.install(p)
if keep:
    patch.install("train.routing_replay")
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig
from slime.utils.routing_replay import RoutingReplay

config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=4, moe_router_topk=2,
                           moe_router_score_function="softmax", moe_aux_loss_coeff=0.0, moe_router_dtype="fp32",
                           use_cpu_initialization=True, add_bias_linear=False)
torch.manual_seed(0)
router = TopKRouter(config, ProcessGroupCollection.use_mpu_process_groups())
out = {"replays": len(RoutingReplay.all_routing_replays), "own": hasattr(router, "routing_replay")}
x = torch.randn(5, 1, 8)
logits = torch.nn.functional.linear(x.view(5, 8), router.weight).float()
out["natural"] = [sorted(r) for r in logits.topk(2, dim=1).indices.tolist()]
forced = torch.tensor(json.loads(sys.argv[2]))

def route(stage):
    os.environ["ROUTING_REPLAY_STAGE"] = stage
    probs, routing_map = router(x)
    experts = [sorted(torch.nonzero(row).flatten().tolist()) for row in routing_map]
    weights = [[round(float(probs[t, e]), 6) for e in row] for t, row in enumerate(experts)]
    return experts, weights

out["record"] = route("record")[0]
if keep:
    replay = RoutingReplay.all_routing_replays[0]
    out["recorded"] = [sorted(r) for r in replay.top_indices_list[0].tolist()]
    replay.clear()
    replay.record(forced); replay.record(forced)
out["replay_forward"], weights = route("replay_forward")
out["replay_backward"] = route("replay_backward")[0]
out["fallthrough"] = route("fallthrough")[0]
out["weights"] = weights
out["expected_weights"] = [[round(float(w), 6) for w in torch.softmax(logits[t, sorted(row)], dim=0)]
                           for t, row in enumerate(forced.tolist())]

# an MTP layer's router (GLM-5's MTP layer is MoE): no replay of its own; while the decoder's replay is current in
# replay_forward, it routes by its own logits and consumes none of the decoder's routes
mtp = TopKRouter(config, ProcessGroupCollection.use_mpu_process_groups(), is_mtp_layer=True)
out["replays_with_mtp"] = len(RoutingReplay.all_routing_replays)
mtp_logits = torch.nn.functional.linear(x.view(5, 8), mtp.weight).float()
out["mtp_natural"] = [sorted(r) for r in mtp_logits.topk(2, dim=1).indices.tolist()]
if keep:
    replay.clear()
    replay.record(forced)
os.environ["ROUTING_REPLAY_STAGE"] = "replay_forward"
router(x)  # the decoder's router: its replay becomes slime's current one, its one recorded route consumed
out["mtp_replay_forward"] = [sorted(torch.nonzero(row).flatten().tolist()) for row in mtp(x)[1]]
if keep:
    out["decoder_consumed"] = replay.forward_index
print(json.dumps(out), flush=True)
import os
os._exit(0)  # no interpreter teardown: the gloo group's destructor can abort the process at exit (SIGABRT)
"""


def _probe(tmp_path, mode: str) -> dict:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = dict(os.environ, SLIME_ASCEND_PLUGINS="cpu")
    proc = subprocess.run([sys.executable, str(script), mode, json.dumps(FORCED)], capture_output=True, text=True,
                          env=env, cwd=str(REPO / "tests"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_megatrons_router_replays_slimes_routes(tmp_path):
    out = _probe(tmp_path, "patched")
    assert out["replays"] == 1 and out["own"] is True  # TopKRouter.__init__ registered slime's replay
    forced = [sorted(r) for r in FORCED]
    assert out["natural"] != forced  # the replayed routes are not the router's own
    assert out["record"] == out["recorded"] == out["natural"]
    assert out["replay_forward"] == out["replay_backward"] == forced
    assert out["weights"] == out["expected_weights"]  # softmax over the replayed experts' logits
    assert out["fallthrough"] == out["natural"]
    # the MTP layer's router: no replay registered (slime's fill_routing_replay fills the decoder's MoE layers and
    # asserts they are all), its own routes while the decoder replays, nothing of the decoder's replay taken
    assert out["replays_with_mtp"] == 1
    assert out["mtp_natural"] != forced and out["mtp_replay_forward"] == out["mtp_natural"]
    assert out["decoder_consumed"] == 1


def test_without_the_patch_megatron_routes_by_its_logits(tmp_path):
    out = _probe(tmp_path, "removed")
    assert out["replays"] == 0 and out["own"] is False
    assert out["replay_forward"] == out["replay_backward"] == out["fallthrough"] == out["natural"]


def test_declared_by_the_cpu_plugin_in_train_actors_that_replay():
    uses = {u.patch: u for u in plugin.PLUGIN.patches}
    assert (uses[PATCH_ID].moment, uses[PATCH_ID].when) == ("train", "slime_ascend.patch.train.routing_replay.wanted")
    p = patch.get(PATCH_ID)
    assert p.process == "train" and (REPO / p.upstream).is_file()
    assert "Device-neutral" in p.why
    assert p.verify() == []  # the installed Megatron-core and slime have the expected shape


def test_refused_on_a_megatron_that_carries_slimes_patch():
    import importlib

    modules = {name: importlib.import_module(name) for name in patch.get(PATCH_ID).target_modules}

    def topk_routing_with_score_function(logits, topk, router_replay=None):  # slime's patched Megatron
        from slime.utils.routing_replay import get_routing_replay_compute_topk  # noqa: F401

    fake = type(sys)("fake_moe_utils")
    fake.topk_routing_with_score_function = topk_routing_with_score_function
    patched = dict(modules, **{routing_replay.MOE_UTILS: fake})
    assert routing_replay.megatron_has_slimes_patch(patched) is True
    assert routing_replay.megatron_has_slimes_patch(modules) is False
    problems = patch.get(PATCH_ID).check(patched)
    assert len(problems) == 1 and "already carries slime's Megatron patch" in problems[0], problems


def test_refused_on_a_slime_that_wires_replay_itself():
    """With upstream proposal 0020 merged slime wires replay by itself; the runtime patch is then not wanted."""
    import importlib
    import types

    modules = {name: importlib.import_module(name) for name in patch.get(PATCH_ID).target_modules}
    slime_0020 = types.ModuleType("slime_0020")
    slime_0020.__dict__.update(vars(modules[routing_replay.SLIME_REPLAY]))
    slime_0020.install_routing_replay = lambda model_chunks: None
    assert routing_replay.slime_wires_replay_itself(slime_0020) is True
    assert routing_replay.slime_wires_replay_itself() is False
    problems = patch.get(PATCH_ID).check(dict(modules, **{routing_replay.SLIME_REPLAY: slime_0020}))
    assert len(problems) == 1 and "install_routing_replay exists" in problems[0], problems

"""train.cpu_moe_splits: Megatron's all-to-all MoE dispatcher gets numpy split sizes from CPU tensors, so its
token dispatch and combine run over gloo. Two processes (expert parallel 2, 4 experts, top 2) dispatch known
tokens with Megatron's own MoEAlltoAllTokenDispatcher under the cpu plugin; the tokens each rank receives and
the combined output are checked against values computed here by hand from the routing."""

import json
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO, need
from slime_ascend import patch
from slime_ascend.cpu import plugin
from slime_ascend.patch.train.cpu_moe_splits import DISPATCHER, host_splits

PATCH_ID = "train.cpu_moe_splits"
# token -> its two experts, per rank (unequal split sizes: all-to-all-v)
ROUTES = {0: [(0, 2), (0, 1), (1, 3)], 1: [(3, 2), (0, 3), (2, 3)]}
HIDDEN = 4

PROBE = r"""
import json, sys
import torch, torch.distributed as dist
rank, port, keep = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "patched"
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
from megatron.core import parallel_state as mpu
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig
from slime_ascend import patch

mpu.initialize_model_parallel(expert_model_parallel_size=2)
out = {"applied": patch.get("train.cpu_moe_splits").applied}
if not keep:
    patch.get("train.cpu_moe_splits").remove()
routes, hidden = json.loads(sys.argv[4]), int(sys.argv[5])
config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1, num_moe_experts=4,
                           moe_router_topk=2, moe_token_dispatcher_type="alltoall", expert_model_parallel_size=2,
                           use_cpu_initialization=True, add_bias_linear=False)
local = [2 * rank, 2 * rank + 1]
dispatcher = MoEAlltoAllTokenDispatcher(2, local, config, ProcessGroupCollection.use_mpu_process_groups())
tokens = len(routes[str(rank)])
x = torch.tensor([[100.0 * rank + 10 * t + h for h in range(hidden)] for t in range(tokens)])
routing_map = torch.zeros(tokens, 4, dtype=torch.bool)
for t, experts in enumerate(routes[str(rank)]):
    routing_map[t, experts] = True
probs = routing_map.float() * 0.5
try:
    tokens_in, probs_in = dispatcher.dispatch_preprocess(x, routing_map, probs)
    tokens_in, probs_in = dispatcher.token_dispatch(tokens_in, probs_in)
    received, per_expert, _ = dispatcher.dispatch_postprocess(tokens_in, probs_in)
    out["received"], out["per_expert"] = received.tolist(), [int(n) for n in per_expert]
    # an "expert" e multiplies by e + 1: received rows are grouped by local expert
    scale = torch.cat([torch.full((int(n), 1), float(e + 1)) for e, n in zip(local, per_expert)])
    y = dispatcher.combine_preprocess(received * scale)
    y = dispatcher.token_combine(y)
    out["combined"] = dispatcher.combine_postprocess(y).tolist()
except Exception as exc:
    out["raised"] = type(exc).__name__ + ": " + str(exc).splitlines()[0]
print(json.dumps(out), flush=True)
import os
os._exit(0)  # no interpreter teardown: the gloo group's destructor can abort the process at exit (SIGABRT)
"""


def _token(rank: int, t: int) -> list[float]:
    return [100.0 * rank + 10 * t + h for h in range(HIDDEN)]


def _expected(rank: int) -> dict:
    """What EP rank ``rank`` receives (its experts in order, then source rank, then token) and each token's
    combined output (sum over its experts e of (e + 1) * token)."""
    received, per_expert = [], []
    for expert in (2 * rank, 2 * rank + 1):
        rows = [_token(src, t) for src in (0, 1) for t, experts in enumerate(ROUTES[src]) if expert in experts]
        received += rows
        per_expert.append(len(rows))
    combined = [[sum(e + 1 for e in experts) * v for v in _token(rank, t)] for t, experts in enumerate(ROUTES[rank])]
    return {"received": received, "per_expert": per_expert, "combined": combined}


def _dispatch(tmp_path, mode: str) -> list[dict]:
    if torch.cuda.is_available():
        pytest.skip("the patch is declared for a host without CUDA")
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    import os

    env = dict(os.environ, SLIME_ASCEND_PLUGINS="cpu")
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), port, mode, json.dumps(ROUTES), str(HIDDEN)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=str(REPO / "tests")) for rank in (0, 1)]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, stderr[-4000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


def test_megatron_dispatches_and_combines_over_gloo(tmp_path):
    need("megatron.core", "Megatron-core: bash scripts/install-slime-cpu.sh")
    outs = _dispatch(tmp_path, "patched")
    for rank, out in enumerate(outs):
        assert out["applied"] is True, out  # the cpu plugin declares it
        assert "raised" not in out, out
        assert {k: out[k] for k in ("received", "per_expert", "combined")} == _expected(rank)


def test_without_the_patch_all_to_all_refuses_tensor_splits(tmp_path):
    need("megatron.core", "Megatron-core: bash scripts/install-slime-cpu.sh")
    for out in _dispatch(tmp_path, "removed"):
        assert out["raised"].startswith("TypeError: all_to_all_single(): incompatible function arguments"), out


def test_a_cpu_tensor_becomes_a_numpy_copy_only_for_as_numpy():
    calls = []

    def original(tensor, as_numpy=False, record_stream=False):
        calls.append((tensor, as_numpy, record_stream))
        return "original"

    wrapped = host_splits(original)
    counts = torch.tensor([[3, 1], [0, 2]])
    splits = wrapped(counts[1], as_numpy=True, record_stream=True)
    assert isinstance(splits, np.ndarray) and splits.tolist() == [0, 2] and calls == []
    counts[1, 1] = 7  # Megatron's splits are views of its token counts: the host value is a copy, as from CUDA
    assert splits.tolist() == [0, 2]
    assert wrapped(counts, record_stream=True) == "original" and calls[-1][1:] == (False, True)
    assert wrapped(None, as_numpy=True) == "original" and calls[-1] == (None, True, False)


def test_declared_when_the_dispatcher_is_imported_on_a_host_without_cuda():
    need("megatron.core", "Megatron-core: bash scripts/install-slime-cpu.sh")
    uses = {u.patch: u for u in plugin.PLUGIN.patches}
    assert (uses[PATCH_ID].moment, uses[PATCH_ID].when) == (f"import:{DISPATCHER}",
                                                            "slime_ascend.cpu.plugin.host_without_cuda")
    p = patch.get(PATCH_ID)
    assert p.process == "train" and p.upstream == "patches/megatron/megatron-moe-host-splits.md"
    assert (REPO / p.upstream).is_file()
    assert p.verify() == []  # the installed Megatron still has the expected shape

"""train.distrib_optimizer_step: Megatron's DistributedOptimizer over torch's Adam (no TE / Apex, as on this host)
saves and resumes a torch_dist checkpoint, and the resumed optimizer is the uninterrupted one.

One process (one gloo rank, the cpu plugin): a tiny bf16 model under Megatron's DDP and distributed optimizer
(AdamW, weight decay on the weights, none on the bias: two param groups) takes 3 steps uninterrupted; a second
copy takes 2, is saved with Megatron's dist_checkpointing, and a third is built, loaded from that checkpoint the
way Megatron's load_checkpoint does (``sharded_state_dict(is_loading=True)``, ``dist_checkpointing.load``,
``load_state_dict``) and takes the 3rd step. With the patch its weights, moments and steps equal the
uninterrupted copy's, for the default ``dp_reshardable`` format and ``fully_reshardable``; without it the load
stops in ``state_dict`` with the AssertionError of slime's ``train.py --load``."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO, need
from slime_ascend import patch
from slime_ascend.cpu import plugin
from slime_ascend.patch.train import distrib_optimizer_step as dos

PATCH_ID = "train.distrib_optimizer_step"

PROBE = r"""
import json, socket, sys, tempfile, traceback

import torch


def main():
    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
    from megatron.core import dist_checkpointing, parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig
    from slime_ascend import patch

    mpu.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1, use_cpu_initialization=True,
                               bf16=True, params_dtype=torch.bfloat16)

    class Tiny(MegatronModule):
        def __init__(self):
            super().__init__(config)
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(4, 4, bias=True, dtype=torch.bfloat16)
            self.out = torch.nn.Linear(4, 2, bias=False, dtype=torch.bfloat16)

        def forward(self, x):
            return self.out(torch.relu(self.lin(x)))

    def build():
        model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                              grad_reduce_in_fp32=True), Tiny())
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, bf16=True,
                                                     use_distributed_optimizer=True, adam_beta1=0.9,
                                                     adam_beta2=0.98), [model])
        return model, opt

    def step(model, opt, i):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i), dtype=torch.bfloat16)
        model.zero_grad_buffer()
        opt.zero_grad()
        model(x).float().pow(2).sum().backward()
        model.finish_grad_sync()
        assert opt.step()[0]

    def inner(opt):
        return opt.chained_optimizers[0].optimizer

    def resume(fmt):
        meta = {"distrib_optim_sharding_type": fmt}
        ref_model, ref_opt = build()
        for i in range(3):
            step(ref_model, ref_opt, i)
        model, opt = build()
        for i in range(2):
            step(model, opt, i)
        ckpt = tempfile.mkdtemp()
        sd = model.sharded_state_dict()
        dist_checkpointing.save({"model": sd, "optimizer": opt.sharded_state_dict(sd, metadata=meta)}, ckpt)
        model, opt = build()
        try:
            sd = model.sharded_state_dict()
            loaded = dist_checkpointing.load(
                {"model": sd, "optimizer": opt.sharded_state_dict(sd, is_loading=True, metadata=meta)}, ckpt)
            model.module.load_state_dict({k.removeprefix("module."): v for k, v in loaded["model"].items()})
            opt.load_state_dict(loaded["optimizer"])
            loaded_steps = sorted(float(s["step"]) for s in inner(opt).state.values())
            step(model, opt, 2)
        except Exception as exc:
            return {"raised": type(exc).__name__, "at": traceback.extract_tb(exc.__traceback__)[-1].name}
        states = list(inner(opt).state.values())
        ref_states = list(inner(ref_opt).state.values())
        return {
            "loaded_steps": loaded_steps,
            "steps": sorted(float(s["step"]) for s in states),
            "step_tensors": len({id(s["step"]) for s in states}),
            "params": len(states),
            "weights_equal": all(torch.equal(p, q) for p, q in zip(ref_model.parameters(), model.parameters())),
            "moments_equal": all(torch.equal(a[k], b[k]) for a, b in zip(ref_states, states)
                                 for k in ("exp_avg", "exp_avg_sq")),
            "saved_again": sorted(g["step"] for g in opt.chained_optimizers[0].state_dict()["optimizer"]["param_groups"]),
        }

    out = {"torch_adam": distrib_optimizer.HAVE_APEX_OR_TE is False,
           "applied": patch.get("train.distrib_optimizer_step").applied}
    for fmt in ("dp_reshardable", "fully_reshardable"):
        out[fmt] = resume(fmt)
    patch.get("train.distrib_optimizer_step").remove()
    out["removed"] = resume("dp_reshardable")
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":  # dist_checkpointing's save starts a multiprocessing manager, which re-imports main
    main()
"""


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    need("megatron.core", "Megatron-core: bash scripts/install-slime-cpu.sh")
    if torch.cuda.is_available():
        pytest.skip("the cpu plugin's shims are for a host without CUDA")
    script = tmp_path_factory.mktemp("distrib_optimizer_step") / "probe.py"
    script.write_text(PROBE)
    import os

    env = dict(os.environ, SLIME_ASCEND_PLUGINS="cpu")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=400,
                          cwd=str(REPO / "tests"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [row for row in proc.stdout.splitlines() if row.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.parametrize("fmt", ["dp_reshardable", "fully_reshardable"])
def test_the_resumed_optimizer_is_the_uninterrupted_one(resumed, fmt):
    assert resumed["torch_adam"] is True and resumed["applied"] is True, resumed  # the cpu plugin declares it here
    out = resumed[fmt]
    assert "raised" not in out, out
    assert out["loaded_steps"] == [2.0] * out["params"], out  # the saved step, not the load template's 0
    assert out["steps"] == [3.0] * out["params"], out  # each param's step advanced once by the 3rd step
    assert out["step_tensors"] == out["params"], out  # one counter per param, as a fresh torch Adam has
    assert out["weights_equal"] and out["moments_equal"], out  # bit for bit the uninterrupted job's
    assert out["saved_again"] == [3.0, 3.0], out  # and the resumed optimizer saves again (both param groups)


def test_without_the_patch_a_checkpoint_load_stops_in_state_dict(resumed):
    assert resumed["removed"] == {"raised": "AssertionError", "at": "state_dict"}, resumed


class _Inner:
    """A torch optimizer's shape: param groups and a defaultdict state."""

    def __init__(self, params):
        import collections

        self.param_groups = [{"params": params[:1]}, {"params": params[1:]}]
        self.state = collections.defaultdict(dict)


class _Owner:
    def __init__(self, inner):
        self.optimizer = inner


class _Module:
    HAVE_APEX_OR_TE = False


def test_an_unstepped_optimizer_reports_step_0_and_keeps_its_state():
    params = [torch.zeros(2), torch.zeros(3)]
    inner = _Inner(params)
    left = {"exp_avg": torch.ones(2)}
    inner.state[params[0]] = left  # an entry without step (what init_state_fn leaves), kept as it is
    seen = {}

    def original(self):
        seen.update({id(p): dict(s) for p, s in self.optimizer.state.items()})
        return "state dict"

    wrapped = dos._state_dict(_Module)(original)
    assert wrapped(_Owner(inner)) == "state dict"
    assert [float(seen[id(p)]["step"]) for p in params] == [0.0, 0.0]  # every param had step 0 during the call
    assert seen[id(params[0])]["exp_avg"] is left["exp_avg"]
    assert dict(inner.state) == {params[0]: left} and inner.state[params[0]] is left  # put back, nothing added

    inner.state[params[1]]["step"] = torch.tensor(5.0)  # stepped: Megatron's own code, untouched
    calls = []
    assert dos._state_dict(_Module)(lambda self: calls.append(dict(self.optimizer.state)) or "x")(_Owner(inner)) == "x"
    assert "step" not in calls[0][params[0]]

    class WithTE:
        HAVE_APEX_OR_TE = True

    fresh = _Inner([torch.zeros(1)])
    dos._state_dict(WithTE)(lambda self: calls.append(len(self.optimizer.state)))(_Owner(fresh))
    assert calls[-1] == 0  # TE / Apex: no step added


def test_after_a_load_each_param_holds_its_own_loaded_step():
    params = [torch.zeros(2), torch.zeros(3), torch.zeros(1)]
    inner = _Inner(params)
    shared = torch.tensor(0.0)
    for p in params:
        inner.state[p] = {"step": shared, "exp_avg": torch.zeros_like(p)}
    loaded = {"optimizer": {"param_groups": [{"lr": 1.0, "step": 4.0}, {"lr": 1.0, "step": 4.0}]}}
    wrapped = dos._load_state_dict(_Module)(lambda self, sd: "loaded")
    assert wrapped(_Owner(inner), loaded) == "loaded"
    steps = [inner.state[p]["step"] for p in params]
    assert [float(s) for s in steps] == [4.0, 4.0, 4.0] and len({id(s) for s in steps}) == 3
    assert all(s.dtype == torch.float32 for s in steps) and float(shared) == 0.0
    assert dos.loaded_step({"param_groups": []}) is None  # Megatron-FSDP's shape: nothing to set
    assert dos.loaded_step({"optimizer": {"param_groups": [{"step": 1.0}, {"step": 2.0}]}}) is None


def test_tensors_without_step_keep_the_live_step():
    main = torch.zeros(2)
    live = torch.tensor(7.0)

    class Owner:
        model_param_group_index_map = {"p": (0, 0)}
        optimizer = type("Opt", (), {"param_groups": [{"params": [main]}], "state": {main: {"step": live}}})()

    got = []
    wrapped = dos._set_states(_Module)(lambda self, model_param, tensors: got.append(tensors))
    src = {"param": torch.ones(2), "exp_avg": torch.ones(2)}
    wrapped(Owner(), "p", src)
    assert got[-1]["step"] is live and got[-1]["exp_avg"] is src["exp_avg"] and "step" not in src
    wrapped(Owner(), "p", {"param": main, "step": torch.tensor(1.0)})
    assert float(got[-1]["step"]) == 1.0  # a step given is Megatron's to copy


def test_declared_by_the_cpu_plugin_where_megatron_has_torch_adam():
    need("megatron.core", "Megatron-core: bash scripts/install-slime-cpu.sh")
    uses = {u.patch: u for u in plugin.PLUGIN.patches}
    assert (uses[PATCH_ID].moment, uses[PATCH_ID].when) == ("import", f"{dos.__name__}.wanted")
    p = patch.get(PATCH_ID)
    assert p.process == "train" and (REPO / p.upstream).is_file()
    assert p.verify() == []  # the installed Megatron still has the expected shape
    from megatron.core.optimizer import distrib_optimizer

    assert dos.wanted() is (distrib_optimizer.HAVE_APEX_OR_TE is False)

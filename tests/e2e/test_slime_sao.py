"""The ``sao`` plugin inside slime's own ``train.py`` on this CPU (``cpu`` plugin).

slime's PPO path with its critic role (``--advantage-estimator ppo``, one sample per prompt,
``--megatron-config-path`` from ``python -m slime_ascend.sao.critic``): a separate critic Megatron
actor next to the policy, both behind slime's RayTrainGroup, rollouts through slime's router to the
torch engine. Evidence comes from slime's own output only:

* K = ``ascend_sao_critic_iters`` critic passes per rollout: slime's ``train`` logs one
  ``critic-step`` metric dict per optimizer step, so K dicts per rollout;
* frozen critic attention: the critic checkpoint slime writes with ``--save`` holds attention
  weights bit-identical to the HF checkpoint it loaded, while its MLP and the policy's attention moved;
* advantages: slime's ``log_rollout_data`` reports ``rollout/advantages``, ``rollout/returns`` and
  ``rollout/values`` for every rollout (``--rm-type random`` makes the reward vary).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slime_ascend.demo.slime_job import make_prompts, run_slime, slime_flags
from e2e_fixtures import engine, model_dir  # noqa: F401  (pytest fixtures)

pytestmark = [pytest.mark.slime, pytest.mark.slow, pytest.mark.slime_loop, pytest.mark.timeout(1200)]

PLUGINS = ("cpu", "sao")
K = 2
NUM_ROLLOUT = 2


def _cli(*argv: str) -> None:
    subprocess.run([sys.executable, *argv], check=True, capture_output=True, text=True)


def _read_dist_checkpoint(root: Path) -> dict:
    """The tensors of the newest Megatron torch_dist checkpoint slime saved under ``root``."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    latest = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    ckpt = root / f"iter_{int(latest):07d}"
    state: dict = {}
    _load_state_dict(state, storage_reader=FileSystemReader(str(ckpt)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _hf_weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _qkv_from_hf(hf: dict, layer: int, heads: int = 4, groups: int = 2, head_dim: int = 16):
    """Megatron's fused ``linear_qkv.weight`` of a GQA layer, built from HF q/k/v (per group: q heads, k, v)."""
    import torch

    p = f"model.layers.{layer}.self_attn."
    q = hf[p + "q_proj.weight"].view(groups, heads // groups * head_dim, -1)
    k = hf[p + "k_proj.weight"].view(groups, head_dim, -1)
    v = hf[p + "v_proj.weight"].view(groups, head_dim, -1)
    return torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])


def _attention_from_hf(hf: dict, layer: int) -> dict:
    """Megatron name (below ``decoder.layers``) -> the HF tensor it is loaded from, attention of one layer."""
    p = f"model.layers.{layer}."
    return {
        "self_attention.linear_qkv.weight": _qkv_from_hf(hf, layer),
        "self_attention.linear_qkv.layer_norm_weight": hf[p + "input_layernorm.weight"],
        "self_attention.linear_proj.weight": hf[p + "self_attn.o_proj.weight"],
        "self_attention.q_layernorm.weight": hf[p + "self_attn.q_norm.weight"],
        "self_attention.k_layernorm.weight": hf[p + "self_attn.k_norm.weight"],
    }


def _layer_tensor(state: dict, layer: int, name: str):
    """One layer's tensor of a torch_dist checkpoint (Megatron stacks the layers: ``decoder.layers.<name>``)."""
    stacked = state.get(f"decoder.layers.{name}")
    if stacked is not None:
        return stacked[layer]
    return state[f"decoder.layers.{layer}.{name}"]


def test_train_py_sao_with_critic_role(model_dir, engine, tmp_path):
    config = tmp_path / "ascend.yaml"
    _cli("-m", "slime_ascend.cli", "config", *PLUGINS, "--set", f"ascend_sao_critic_iters={K}", "-o", str(config))
    # the critic role (attention frozen) that `config` wrote beside the YAML, given its own checkpoint directory
    critic_ckpt, role = tmp_path / "critic_ckpt", str(tmp_path / "sao_megatron.yaml")
    _cli("-m", "slime_ascend.sao.critic", "-o", role, "--merge", role, "--set", f"save={critic_ckpt}")
    prompts = make_prompts(tmp_path / "prompts.jsonl")
    flags = slime_flags(model_dir, prompts, [engine], tmp_path, num_rollout=NUM_ROLLOUT, batch=4, n_samples=1)
    run = run_slime("train.py", flags, tmp_path, PLUGINS, custom_config=config)
    assert run.returncode == 0, run.log[-6000:]

    for role in ("RolloutManager", "MegatronTrainRayActor"):
        assert any(role in line and "slime-ascend plugins active: cpu, sao" in line
                   for line in run.log.splitlines()), role
    for patch_id in ("train.critic_train_iters", "train.critic_advantage_function", "train.critic_hf_value_head"):
        assert f"applied runtime patch {patch_id}" in run.log

    metrics = run.metrics()
    critic_steps = [m for m in metrics if "train/critic-grad_norm" in m]
    actor_steps = [m for m in metrics if "train/grad_norm" in m]
    # K value-loss passes per rollout, one policy step per rollout (one step per rollout: gbs = batch)
    assert [m["train/step"] for m in critic_steps] == [r for r in range(NUM_ROLLOUT) for _ in range(K)], critic_steps
    assert [m["train/step"] for m in actor_steps] == list(range(NUM_ROLLOUT)), actor_steps
    assert any(m["train/critic-grad_norm"] > 0 for m in critic_steps), critic_steps
    assert any(m["train/grad_norm"] > 0 for m in actor_steps), actor_steps

    # advantages (and the critic's values and returns they come from) reached slime's rollout-data log
    rollout_logs = [m for m in metrics if "rollout/advantages" in m]
    assert len(rollout_logs) >= NUM_ROLLOUT, [sorted(m) for m in metrics]
    for m in rollout_logs:
        assert "rollout/values" in m and "rollout/returns" in m, m
    # random 0/1 rewards: the rollout-level mean advantage is not identically zero
    assert any(m["rollout/advantages"] != 0 for m in rollout_logs), rollout_logs

    # frozen critic attention, read back from the critic checkpoint slime saved: bit-identical to the HF
    # weights it loaded; its MLP trained; the policy's attention trained
    hf = _hf_weights(model_dir)
    critic = _read_dist_checkpoint(critic_ckpt)
    actor = _read_dist_checkpoint(tmp_path / "ckpt")
    for layer in range(2):
        for name, want in _attention_from_hf(hf, layer).items():
            got = _layer_tensor(critic, layer, name)
            assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape, want.shape)
            assert got.equal(want), f"critic layer {layer} {name} changed"
        fc2 = _layer_tensor(critic, layer, "mlp.linear_fc2.weight")
        assert not fc2.equal(hf[f"model.layers.{layer}.mlp.down_proj.weight"]), f"critic layer {layer} MLP did not train"
        qkv = _layer_tensor(actor, layer, "self_attention.linear_qkv.weight")
        assert not qkv.equal(_qkv_from_hf(hf, layer)), f"actor layer {layer} attention did not train"
